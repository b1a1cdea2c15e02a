"""The native paged decode attention against a plain softmax(q k^T) v over each request's gathered context."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import cpu_kernels


def test_kernel_builds_here():
    # CI runs on the machine kind users serve from: a silent fallback to the slow path would go unnoticed.
    assert cpu_kernels.available(torch.float32, torch.device("cpu"))
    assert not cpu_kernels.available(torch.bfloat16, torch.device("cpu"))
    # Loading the library must not switch the process to flush-to-zero (crtfastmath.o): subnormals survive.
    tiny = float("5e-324")
    assert tiny > 0.0 and tiny * 2 == float("1e-323")


def reference(q, key_cache, value_cache, block_table, seq_lens, scale):
    out = torch.empty_like(q)
    group = q.shape[1] // key_cache.shape[2]
    bs = key_cache.shape[1]
    for s in range(q.shape[0]):
        n = int(seq_lens[s])
        blocks = block_table[s, : -(-n // bs)].long()
        k = key_cache[blocks].reshape(-1, *key_cache.shape[2:])[:n].double()  # [n, Hkv, D]
        v = value_cache[blocks].reshape(-1, *value_cache.shape[2:])[:n].double()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [n, H, D]
        scores = torch.einsum("hd,nhd->hn", q[s].double(), k) * scale
        out[s] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).float()
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),  # SmolLM2
    (4, 4, 32, 8),  # no GQA
    (8, 2, 48, 16),  # head_dim a multiple of 8, not of 16
    (6, 3, 20, 4),  # head_dim not a multiple of 8: the scalar loops
])
def test_matches_reference(heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(heads * 1000 + head_dim)
    num_blocks, seqs = 200, 7
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    seq_lens = torch.tensor([1, 2, block_size, block_size + 1, 100, 37, 5 * block_size], dtype=torch.int32)
    width = int(-(-seq_lens.max() // block_size)) + 3  # rows wider than any request needs
    block_table = torch.randperm(num_blocks, generator=gen)[: seqs * width].view(seqs, width).to(torch.int32)
    q = torch.randn(seqs, heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = cpu_kernels.paged_decode_attention(q, key_cache, value_cache, block_table, seq_lens, scale)
    torch.testing.assert_close(out, reference(q, key_cache, value_cache, block_table, seq_lens, scale),
                               atol=2e-6, rtol=1e-5)


def test_result_does_not_depend_on_threads_or_batch():
    gen = torch.Generator().manual_seed(0)
    key_cache, value_cache = torch.randn(2, 64, 16, 3, 64, generator=gen)
    block_table = torch.randperm(64, generator=gen)[:48].view(8, 6).to(torch.int32)
    seq_lens = torch.randint(1, 96, (8,), generator=gen, dtype=torch.int32)
    q = torch.randn(8, 9, 64, generator=gen)
    threads = torch.get_num_threads()
    outs = []
    for n in (1, 2):
        torch.set_num_threads(n)
        outs.append(cpu_kernels.paged_decode_attention(q, key_cache, value_cache, block_table, seq_lens, 0.125))
    torch.set_num_threads(threads)
    alone = cpu_kernels.paged_decode_attention(q[3:4], key_cache, value_cache, block_table[3:4], seq_lens[3:4], 0.125)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0][3:4], alone)
