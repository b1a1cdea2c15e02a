"""What the KV cache dtype costs a decode step: the fused decode attention call (rotary, K/V write, attention over
the paged cache) of one layer, SmolLM2-135M shapes (9 query heads, 3 KV heads, D 64), context ~320, batch 16 and 64,
one thread, timed in thread CPU time (on a shared machine wall time measures the queue): fp32, bf16, fp8 e4m3 with
scale 1, and e4m3 with scales and error-feedback K rounding (the --calculate-kv-scales default). Prints the median
ms per layer call and x 30 layers (a step's attention).

    .venv/bin/python benchmarks/micro_kv_dtype_decode.py
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

from pagedllm.kernels import cpu_kernels
from pagedllm.worker.kv_scales import error_feedback_weights

H, HKV, D, BS, CONTEXT, LAYERS = 9, 3, 64, 16, 320, 30


def median_cpu_ms(fn, n: int = 31) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    queries = torch.randn(HKV, 1000, D, generator=gen, dtype=torch.float64) + 3 * torch.randn(HKV, 1, D, generator=gen,
                                                                                               dtype=torch.float64)
    k_comp = error_feedback_weights(queries.transpose(1, 2) @ queries / 1000)
    cases = {"fp32": (torch.float32, 1.0, 1.0, None), "bf16": (torch.bfloat16, 1.0, 1.0, None),
             "fp8 e4m3 scale 1": (torch.float8_e4m3fn, 1.0, 1.0, None),
             "fp8 e4m3 calibrated": (torch.float8_e4m3fn, 0.125, 0.0625, k_comp)}
    print(f"{'batch':>5s} {'kv dtype':22s} {'ms / layer':>10s} {'ms / step (30 layers)':>22s}")
    for batch in (16, 64):
        nb = -(-(CONTEXT + 1) // BS)
        num_blocks = batch * nb
        block_table = torch.randperm(num_blocks, generator=gen).view(batch, nb).to(torch.int32)
        seq_lens = torch.full((batch,), CONTEXT + 1, dtype=torch.int32)
        slots = block_table[:, CONTEXT // BS].long() * BS + CONTEXT % BS
        qkv = torch.randn(batch, (H + 2 * HKV) * D, generator=gen)
        angles = torch.rand(batch, D // 2, generator=gen)
        cos_sin = torch.stack([angles.cos(), angles.sin()], dim=1).contiguous()
        values = torch.randn(2, num_blocks, BS, HKV, D, generator=gen) * 2
        for name, (dtype, k_scale, v_scale, comp) in cases.items():
            cache = (values / torch.tensor([k_scale, v_scale]).view(2, 1, 1, 1, 1)).to(dtype)
            # qkv is rotated in place on every call: the same work each time
            ms = median_cpu_ms(functools.partial(cpu_kernels.fused_decode_attention, qkv, cos_sin, slots, cache,
                                                 block_table, seq_lens, D**-0.5, H, k_scale, v_scale, comp))
            print(f"{batch:5d} {name:22s} {ms:10.3f} {ms * LAYERS:22.1f}", flush=True)


if __name__ == "__main__":
    main()
