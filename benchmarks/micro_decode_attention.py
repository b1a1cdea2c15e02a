"""Decode attention variants at batch 64, context 320, SmolLM2 shapes (3 KV heads x 3 query heads, D 64), one
thread: the runner's bool-mask SDPA over gathered blocks, a float mask, contiguous K/V, the math backend,
hand-written matmul/softmax, and the gathers themselves. Prints median ms and max |diff| from the current path.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

B, L, HKV, G, D, BS, NUM_BLOCKS = 64, 320, 3, 3, 64, 16, 5000


def median_ms(fn, n: int = 15) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(sorted(times)[n // 2] * 1e3, 2)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    nb = L // BS
    blocks = torch.randn(2, NUM_BLOCKS, BS * HKV * D)  # [2, num_blocks, block_size * Hkv * D]
    ids = torch.randperm(NUM_BLOCKS)[: B * nb]
    q = torch.randn(B, HKV, G, D)
    lens = torch.randint(L - 15, L + 1, (B,))
    mask = (torch.arange(L)[None] < lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    float_mask = torch.zeros(B, 1, 1, L).masked_fill(~mask, float("-inf"))
    k = blocks[0].index_select(0, ids).view(B, L, HKV, D).transpose(1, 2)  # [B, Hkv, L, D] strided
    v = blocks[1].index_select(0, ids).view(B, L, HKV, D).transpose(1, 2)
    kc, vc = k.contiguous(), v.contiguous()
    scale = D**-0.5

    def manual(keys, values):
        scores = torch.matmul(q, keys.transpose(2, 3)).mul_(scale).add_(float_mask)  # [B, Hkv, G, L]
        return torch.matmul(scores.softmax(-1), values)

    def math_backend():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    variants = {
        "current (bool mask, strided K/V)": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                   scale=scale),
        "float mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask, scale=scale),
        "contiguous K/V": lambda: F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=scale),
        "math backend": math_backend,
        "manual matmul/softmax": lambda: manual(k, v),
        "manual, contiguous K/V": lambda: manual(kc, vc),
        "gather K and V (index_select)": lambda: (blocks[0].index_select(0, ids), blocks[1].index_select(0, ids)),
        "transposing copy of K": lambda: k.contiguous(),
    }
    reference = variants["current (bool mask, strided K/V)"]()
    for name, fn in variants.items():
        out = fn()
        diff = (out - reference).abs().max().item() if isinstance(out, torch.Tensor) else ""
        print(f"{name}: {median_ms(fn)} ms {diff}")


if __name__ == "__main__":
    main()
