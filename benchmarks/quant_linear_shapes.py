"""Per-shape time of one linear layer on SmolLM2-135M's shapes, in one sitting: oneDNN fp32 on the dequantized
weight (the path before quantized execution), the lossless quantized kernel (quant_linear_cpu.c, the GGUF
default) and the 8-bit-activation kernel (quant_q8act_cpu.c, `activation_quantization="int8"`).

    python benchmarks/quant_linear_shapes.py [--reps 7] [--threads 2] [--m 1,4,16,64,256,2048] [--clock wall|cpu]

Weights are random GGUF blocks of the type the default model uses for each shape (Q4_1 linears, the Q8_0 tied
LM head). Prints the median milliseconds per call of each path and the int8 kernel's speed-up over each.
On a crowded machine two-thread wall times measure the queue (a parallel region waits for a descheduled thread):
there `--threads 1 --clock cpu` times the work itself.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from pagedllm.layers.int8_activation_weight import Int8ActivationWeight
from pagedllm.layers.linear import Linear
from pagedllm.layers.quantized_weight import PackedWeight
from pagedllm.models.gguf_unpack import unpack

SHAPES = {  # name: (out_features N, in_features K, GGUF type in the default model)
    "qkv_proj": (960, 576, Q.Q4_1),
    "o_proj": (576, 576, Q.Q4_1),
    "gate_up_proj": (3072, 576, Q.Q4_1),
    "down_proj": (576, 1536, Q.Q4_1),
    "lm_head": (49152, 576, Q.Q8_0),
}


def random_blocks(qtype: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n * k // block_size, type_size), dtype=np.uint8)
    for off in (0, 2) if qtype == Q.Q4_1 else (0,):
        blocks[:, off:off + 2] = rng.uniform(-0.02, 0.02, blocks.shape[0]).astype(np.float16).view(np.uint8) \
            .reshape(-1, 2)
    return blocks.reshape(-1)


def median_ms(fn, x: torch.Tensor, reps: int, clock=time.perf_counter) -> float:
    """Median of `reps` timed calls; each timed call repeats fn until it has run >= 20 ms (noisy shared CPU)."""
    fn(x)  # warm-up
    t0 = clock()
    fn(x)
    inner = max(1, int(0.02 / max(clock() - t0, 1e-6)))
    times = []
    for _ in range(reps):
        t0 = clock()
        for _ in range(inner):
            fn(x)
        times.append((clock() - t0) / inner)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--m", default="1,4,16,64,256,2048", help="rows per call (tokens in the step)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: process CPU time (with --threads 1, the compute time even when other jobs take "
                             "the core; with more threads it counts OpenMP's spinning too)")
    args = parser.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"{'shape':14} {'M':>5} {'onednn ms':>10} {'lossless ms':>12} {'int8-act ms':>12} {'x onednn':>9} "
          f"{'x lossless':>10}")
    for name in args.shapes.split(","):
        n, k, qtype = SHAPES[name]
        raw = random_blocks(qtype, n, k, rng)
        dense = Linear(k, n, bias=False)
        dense.weight = torch.nn.Parameter(torch.from_numpy(np.asarray(dequantize(raw, qtype), np.float32)
                                                           .reshape(n, k)), requires_grad=False)
        dense.pack_weights()
        quantized = unpack(raw, qtype, (n, k))
        lossless, int8 = PackedWeight.from_codes(quantized), Int8ActivationWeight.from_quantized(quantized)
        for m in (int(v) for v in args.m.split(",")):
            if name == "lm_head" and m > 256:
                continue  # logits are computed for sampled rows only: at most max_num_seqs per step
            x = torch.randn(m, k)
            with torch.inference_mode():
                t_dense = median_ms(dense, x, args.reps, clock)
                t_lossless = median_ms(lossless.matmul, x, args.reps, clock)
                t_q8 = median_ms(int8.matmul, x, args.reps, clock)
            print(f"{name:14} {m:5d} {t_dense:10.3f} {t_lossless:12.3f} {t_q8:12.3f} {t_dense / t_q8:9.2f} "
                  f"{t_lossless / t_q8:10.2f}", flush=True)


if __name__ == "__main__":
    main()
