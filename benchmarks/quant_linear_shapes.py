"""Per-shape time of one linear layer: oneDNN fp32 (today's path) against the 8-bit-activation kernel (and the
lossless quantized kernel where the branch has one), on SmolLM2-135M's shapes, in one sitting.

    python benchmarks/quant_linear_shapes.py [--reps 7] [--threads 2] [--m 1,4,16,64,256,2048]

Weights are random GGUF blocks of the type the default model uses for each shape (Q4_1 linears, the Q8_0 tied
LM head). Prints the median milliseconds per call of each path and the ratio to oneDNN (x > 1: faster).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from pagedllm.kernels import quant_q8act as qa8
from pagedllm.layers.linear import Linear

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


def median_ms(fn, x: torch.Tensor, reps: int) -> float:
    """Median of `reps` timed calls; each timed call repeats fn until it has run >= 20 ms (noisy shared CPU)."""
    fn(x)  # warm-up
    t0 = time.perf_counter()
    fn(x)
    inner = max(1, int(0.02 / max(time.perf_counter() - t0, 1e-6)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn(x)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--m", default="1,4,16,64,256,2048", help="rows per call (tokens in the step)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"{'shape':14} {'M':>5} {'onednn ms':>10} {'int8-act ms':>12} {'x':>6}")
    for name in args.shapes.split(","):
        n, k, qtype = SHAPES[name]
        raw = random_blocks(qtype, n, k, rng)
        dense = Linear(k, n, bias=False)
        dense.weight = torch.nn.Parameter(torch.from_numpy(np.asarray(dequantize(raw, qtype), np.float32)
                                                           .reshape(n, k)), requires_grad=False)
        dense.pack_weights()
        packed = qa8.Q8ActWeight(qa8.pack_gguf(raw, qtype, n, k))
        for m in (int(v) for v in args.m.split(",")):
            if name == "lm_head" and m > 256:
                continue  # logits are computed for sampled rows only: at most max_num_seqs per step
            x = torch.randn(m, k)
            with torch.inference_mode():
                t_dense = median_ms(dense, x, args.reps)
                t_q8 = median_ms(functools.partial(qa8.linear, w=packed), x, args.reps)
            print(f"{name:14} {m:5d} {t_dense:10.3f} {t_q8:12.3f} {t_dense / t_q8:6.2f}", flush=True)


if __name__ == "__main__":
    main()
