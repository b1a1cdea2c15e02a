"""Natively (fp32 activations on the CPU), a prefill row attends exactly as a decode row of its position: a prompt
prefilled in one chunk, in several chunks, after a cached prefix, or token by token gives the same outputs bit for
bit, and the same K/V (kernels/multirow_attention.py)."""

from __future__ import annotations

import pytest
import torch
from tests.layers.test_attention_verify import _metadata, _run

from pagedllm.layers.attention import PagedAttention

H, HKV, D, BS = 9, 3, 64, 16  # SmolLM2's heads: the tiled kernel path
PROMPT = 150  # crosses KV_CHUNK (64) and block boundaries at odd offsets


def _prefill(layer, kv, table, qkv, cos_sin, chunks):
    """The prompt through `chunks` (token counts) steps; each chunk's row outputs."""
    outs, start = [], 0
    for n in chunks:
        slots = [table[p // BS] * BS + p % BS for p in range(start, start + n)]
        md = _metadata([n], [start + n], [table], slots)
        outs.append(_run(layer, kv, md, qkv[start:start + n], cos_sin[start:start + n]))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_chunking_and_cached_prefixes_do_not_change_a_rows_bits(kv_dtype):
    torch.manual_seed(0)
    layer = PagedAttention(H, HKV, D, layer_idx=0)
    table = list(torch.randperm(24)[:12].tolist())  # blocks anywhere in the pool
    qkv = torch.randn(PROMPT, (H + 2 * HKV) * D)
    cos_sin = torch.randn(PROMPT, 2, D // 2)

    def run(chunks):
        kv = torch.zeros(2, 24, BS, HKV, D, dtype=kv_dtype)
        return _prefill(layer, kv, table, qkv, cos_sin, chunks), kv

    one, kv_one = run([PROMPT])
    for chunks in ([64, 86], [37, 1, 100, 12], [96, 54]):  # [96, 54]: a 6-block cached prefix, then the rest
        out, kv = run(chunks)
        assert torch.equal(out, one), chunks
        assert torch.equal(kv.view(torch.uint8), kv_one.view(torch.uint8)), chunks
    decodes, _ = run([1] * 70 + [PROMPT - 70])  # 70 decode steps, then a chunk
    assert torch.equal(decodes, one)
