"""Decode attention with its KV cache in DRAM, as at a large batch: 30 layers, each with its own cache, SmolLM2
shapes (9 query heads, 3 KV heads, D 64, block size 16), batch B, context ~L (L-15..L), the blocks of every request
scattered over the pool (random order) or, with --contiguous, one run per request. Times the native
paged_decode_attention of all 30 layers (one step's attention, without the rotary and K/V write) at the thread
count torch has, and prints the median of 7 steps and the bytes of K and V read per second.

    .venv/bin/python benchmarks/micro_decode_attention_dram.py [--batch 128] [--context 320] [--kv-dtype fp32]

A layer's K and V at batch 128 and context 320 are 61 MB in fp32, so every step reads them from DRAM (the
one-layer micro_kv_dtype_decode.py keeps them in L3 at batch 16).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.kernels import cpu_kernels

LAYERS, H, HKV, D, BS = 30, 9, 3, 64, 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--context", type=int, default=320)
    parser.add_argument("--kv-dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--contiguous", action="store_true", help="each request's blocks in one run")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    b, ctx = args.batch, args.context
    nb = (ctx + BS - 1) // BS
    num_blocks = b * nb
    caches = [torch.randn(2, num_blocks, BS, HKV, D, generator=gen).to(DTYPES[args.kv_dtype]) for _ in range(LAYERS)]
    order = torch.arange(num_blocks) if args.contiguous else torch.randperm(num_blocks, generator=gen)
    block_table = order.to(torch.int32).view(b, nb).contiguous()
    seq_lens = torch.randint(ctx - 15, ctx + 1, (b,), dtype=torch.int32, generator=gen)
    q = torch.randn(b, H, D, generator=gen)

    def step() -> None:
        for cache in caches:
            cpu_kernels.paged_decode_attention(q, cache[0], cache[1], block_table, seq_lens, D**-0.5)

    step()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    gb = LAYERS * 2 * float(seq_lens.sum()) * HKV * D * caches[0].element_size() / 1e9
    print(f"batch {b}, context ~{ctx}, {args.kv_dtype}, {'contiguous' if args.contiguous else 'scattered'} blocks, "
          f"{torch.get_num_threads()} threads: {median * 1e3:.1f} ms per step ({median * 1e3 / LAYERS:.2f} ms per "
          f"layer), {gb:.2f} GB of K/V, {gb / median:.1f} GB/s")


if __name__ == "__main__":
    main()
