"""Quantized linear kernels (layers/quantized_weight.py) against today's path (dequantized fp32 weights in
oneDNN's packed layout) on SmolLM2-135M's shapes, one table row per (layer, M), old and new timed interleaved in
the same run (the machine is shared: compare the ratio, not the absolute times).

    .venv/bin/python benchmarks/quant_linear.py [--rows 1 4 16 64 256 2048] [--reps 9] [--threads N]
        [--qtype Q4_1] [--layers qkv o gate_up down lm_head] [--clock wall|cpu]

Prints a line per shape: M, median ms per call (oneDNN, quantized), GFLOP/s of each, new/old time of the
medians and of the best runs (on an oversubscribed machine, --threads 1 and the best runs are the steadier).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from pagedllm.layers.linear import Linear
from pagedllm.layers.quantized_weight import PackedWeight
from pagedllm.models.gguf_unpack import unpack

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def layers(name: str, qtype: str) -> tuple[Linear, Linear]:
    n, k = SHAPES[name]
    qt = GGMLQuantizationType[qtype if name != "lm_head" else "Q8_0"]
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32) * 0.05
    packed = PackedWeight.from_codes(unpack(quantize(w, qt), qt, (n, k)))
    old, new = Linear(k, n, bias=False), Linear(k, n, bias=False)
    old.weight = torch.nn.Parameter(packed.dequantize(), requires_grad=False)
    old.pack_weights()
    new.set_quantized_weight(packed)
    return old, new


def timed(fn, x: torch.Tensor, clock) -> float:
    start = clock()
    fn(x)
    return clock() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 2048])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--qtype", default="Q4_1")
    parser.add_argument("--layers", nargs="+", default=list(SHAPES))
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: process CPU time (with --threads 1, the compute time even when other jobs "
                             "take the core; with more threads it counts OpenMP's spinning too)")
    args = parser.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, {args.qtype} (lm_head Q8_0), {args.clock} time, median of {args.reps}")
    with torch.inference_mode():
        for name in args.layers:
            old, new = layers(name, args.qtype)
            n, k = SHAPES[name]
            for m in args.rows:
                if name == "lm_head" and m > 256:
                    continue  # logits are computed for the sampled tokens only
                x = torch.randn(m, k)
                old(x), new(x)  # warm up
                t_old, t_new = [], []
                for _ in range(args.reps):
                    t_old.append(timed(old, x, clock))
                    t_new.append(timed(new, x, clock))
                a, b = statistics.median(t_old), statistics.median(t_new)
                flop = 2 * m * n * k
                print(f"{name:8s} M={m:5d}  onednn {a * 1e3:8.3f} ms {flop / a / 1e9:6.1f} GF/s   "
                      f"quant {b * 1e3:8.3f} ms {flop / b / 1e9:6.1f} GF/s   new/old {b / a:5.2f} "
                      f"(best of each: {min(t_new) / min(t_old):5.2f})", flush=True)


if __name__ == "__main__":
    main()
