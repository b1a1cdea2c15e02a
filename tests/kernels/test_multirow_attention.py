"""The multi-row paged attention kernel against the decode kernel, row by row: bitwise equal, so speculative
verify rows and prefill rows get exactly a decode row's bits."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import cpu_kernels
from pagedllm.kernels.multirow_attention import paged_multirow_attention


def _case(kv_dtype, heads, kv_heads, head_dim, block_size, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 200
    caches = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    key_cache, value_cache = (c.to(kv_dtype).contiguous() for c in caches)
    # groups: (rows, context length of the last row); odd lengths across KV_CHUNK (64) and block boundaries
    groups = [(1, 1), (5, 70), (37, 131), (3, 3), (20, 64), (1, 129)]
    width = max(-(-n // block_size) for _, n in groups) + 2
    block_table = torch.randperm(num_blocks, generator=gen)[: len(groups) * width].view(len(groups), width)
    block_table = block_table.to(torch.int32)
    row_start = torch.tensor([0] + [r for r, _ in groups], dtype=torch.int64).cumsum(0)
    seq_lens = torch.cat([torch.arange(n - r + 1, n + 1) for r, n in groups]).to(torch.int32)
    rows = int(row_start[-1])
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen)  # q rows with a wider stride
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    row_tables = block_table.repeat_interleave(torch.tensor([r for r, _ in groups]), dim=0).contiguous()
    return q, key_cache, value_cache, block_table, row_start, seq_lens, row_tables


@pytest.mark.parametrize("kv_dtype,scales", [(torch.float32, (1.0, 1.0)), (torch.bfloat16, (1.0, 1.0)),
                                             (torch.float8_e4m3fn, (0.5, 2.0)), (torch.float8_e5m2, (1.0, 0.25))])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),  # SmolLM2: the tiled path
    (4, 2, 64, 5),  # odd block size
    (8, 2, 48, 8),  # head_dim not 64: each row through the decode kernel
])
def test_every_row_is_bitwise_the_decode_kernels(kv_dtype, scales, heads, kv_heads, head_dim, block_size):
    q, kc, vc, table, row_start, seq_lens, row_tables = _case(kv_dtype, heads, kv_heads, head_dim, block_size,
                                                              seed=heads * 100 + block_size)
    k_scale, v_scale = scales
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            decode = cpu_kernels.paged_decode_attention(q, kc, vc, row_tables, seq_lens, head_dim**-0.5, k_scale,
                                                        v_scale)
            multi = paged_multirow_attention(q, kc, vc, table, row_start, seq_lens, head_dim**-0.5, k_scale, v_scale)
            for r in range(q.shape[0]):
                assert torch.equal(multi[r], decode[r]), f"row {r} (length {int(seq_lens[r])}), {n} threads"
    finally:
        torch.set_num_threads(threads)


def test_a_groups_rows_do_not_depend_on_the_other_groups():
    """Each group alone (on 2 threads a lone group of a few rows is cut into smaller tiles, to give both threads
    work) has the bits it has among the others."""
    q, kc, vc, table, row_start, seq_lens, _ = _case(torch.float32, 9, 3, 64, 16, seed=1)
    multi = paged_multirow_attention(q, kc, vc, table, row_start, seq_lens, 0.125)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for g in range(len(table)):
                a, b = int(row_start[g]), int(row_start[g + 1])
                alone = paged_multirow_attention(q[a:b], kc, vc, table[g:g + 1], torch.tensor([0, b - a]),
                                                 seq_lens[a:b], 0.125)
                assert torch.equal(multi[a:b], alone), f"group {g} ({b - a} rows), {n} threads"
    finally:
        torch.set_num_threads(threads)
