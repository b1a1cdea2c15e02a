"""Per-layer attention options (layers/attention.py, kernels/paged_attention_cpu.c): a sliding window, logit
soft-capping and a custom softmax scale, on every path (native prefill rows, the fused native decode, the torch
paths) and KV dtype (fp32, fp8), against a plain torch reference: the query at position p attends the keys at
positions > p - window (transformers' sliding_window_overlay), scores = cap * tanh(scale * q.k / cap)."""

from __future__ import annotations

import pytest
import torch
from tests.layers.test_attention_verify import _metadata, _run

from pagedllm.kernels import cpu_kernels
from pagedllm.layers.attention import PagedAttention

BS, PROMPT, NUM_BLOCKS = 8, 70, 24
NATIVE = cpu_kernels.available(torch.float32, torch.device("cpu"))


def _reference(q, k, v, window, softcap, scale):
    # q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H, D]
    t, h, d = q.shape
    group = h // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.arange(t)
    visible = pos[None, :] <= pos[:, None]
    if window:
        visible &= pos[None, :] > pos[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


def _prefill(layer, kv, table, qkv, cos_sin, chunks):
    outs, start = [], 0
    for n in chunks:
        slots = [table[p // BS] * BS + p % BS for p in range(start, start + n)]
        md = _metadata([n], [start + n], [table], slots)
        outs.append(_run(layer, kv, md, qkv[start:start + n], cos_sin[start:start + n]))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("heads,kv_heads,head_dim,window,softcap,scale", [
    (4, 2, 64, 13, None, None), (4, 2, 64, None, 5.0, 0.3), (4, 2, 64, 16, 2.0, 0.07),
    (4, 2, 48, 16, 2.0, 0.07),  # head_dim not 64: the kernels' generic loops
])
@pytest.mark.parametrize("native", [True, False] if NATIVE else [False])
def test_window_softcap_and_scale_match_a_torch_reference(monkeypatch, kv_dtype, heads, kv_heads, head_dim, window,
                                                          softcap, scale, native):
    """A 70-token prompt in one chunk, in two chunks (the second starting mid-window, as after a prefix cache
    hit), and token by token (decodes): each row equals the reference on the K/V the cache holds; natively the
    three runs are bitwise equal (a windowed row of a chunk is the decode kernel's row)."""
    if not native:
        monkeypatch.setattr(cpu_kernels, "kv_cache_native", lambda *args: False)
    torch.manual_seed(heads + head_dim)
    layer = PagedAttention(heads, kv_heads, head_dim, 0, sliding_window=window, logit_softcap=softcap, scale=scale)
    table = torch.randperm(NUM_BLOCKS)[: PROMPT // BS + 1].tolist()  # blocks anywhere in the pool
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(PROMPT, q_size + 2 * kv_size)
    cos_sin = torch.stack([torch.ones(PROMPT, head_dim // 2), torch.zeros(PROMPT, head_dim // 2)], dim=1)  # no-op
    runs = []
    for chunks in ([PROMPT], [29, PROMPT - 29], [1] * PROMPT):
        kv = torch.zeros(2, NUM_BLOCKS, BS, kv_heads, head_dim, dtype=kv_dtype)
        out = _prefill(layer, kv, table, qkv, cos_sin, chunks).view(PROMPT, heads, head_dim)
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(PROMPT)])
        cached = kv.view(2, -1, kv_heads, head_dim)[:, slots].float()  # [2, T, Hkv, D] as stored
        if kv_dtype == torch.float32:
            assert torch.equal(cached[0], qkv[:, q_size:q_size + kv_size].view(PROMPT, kv_heads, head_dim))
        want = _reference(qkv[:, :q_size].view(PROMPT, heads, head_dim), cached[0], cached[1], window, softcap,
                          head_dim**-0.5 if scale is None else scale)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
        runs.append(out)
    if native:
        assert torch.equal(runs[1], runs[0]) and torch.equal(runs[2], runs[0])


def test_a_window_wider_than_the_context_is_full_attention():
    """window >= the context: the same bits as no window (the default path)."""
    torch.manual_seed(0)
    qkv = torch.randn(20, (4 + 4) * 64)
    cos_sin = torch.randn(20, 2, 32)
    outs = []
    for window in (None, 20, 64):
        kv = torch.zeros(2, 8, BS, 2, 64)
        outs.append(_prefill(PagedAttention(4, 2, 64, 0, sliding_window=window), kv, [3, 1, 5], qkv, cos_sin,
                             [7, 1, 12]))
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])
