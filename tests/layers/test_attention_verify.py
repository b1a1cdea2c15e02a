"""Verify rows (speculative decoding) attend exactly like decode rows: one step that verifies 3 drafts gives the
same outputs, bit for bit, as 3 plain decode steps, and the K/V it writes are the same."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.layers.attention import PagedAttention, build_plan
from pagedllm.layers.forward_context import AttentionMetadata, set_forward_context

H, HKV, D, BS = 4, 2, 16, 4


def _metadata(query_lens, seq_lens, block_table, slots, verify_reqs=None) -> AttentionMetadata:
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    seq = np.asarray(seq_lens, dtype=np.int64)
    return AttentionMetadata(
        num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens), max_seq_len=int(seq.max()),
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)), seq_lens=torch.from_numpy(seq.astype(np.int32)),
        block_table=torch.tensor(block_table, dtype=torch.int32), slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq,
        verify_reqs=None if verify_reqs is None else np.asarray(verify_reqs))


def _run(layer, kv, md, qkv, cos_sin):
    with set_forward_context(md, [kv]):
        return layer(qkv.clone(), cos_sin)


def test_plan_gives_each_verify_row_its_own_context_length():
    md = _metadata([1, 3], [9, 20], [[0, 1, 2, 0, 0, 0], [3, 4, 5, 6, 7, 0]], list(range(4)), verify_reqs=[1])
    plan = build_plan(md, BS, native=True)
    assert plan.all_decode and plan.has_verify and not plan.prefills
    assert plan.decode_rows.tolist() == [0, 1, 2, 3]
    assert plan.decode_seq_lens.tolist() == [9, 18, 19, 20]
    assert plan.decode_block_table[:, :2].tolist() == [[0, 1], [3, 4], [3, 4], [3, 4]]


@pytest.mark.parametrize("with_other_decode", [False, True])
def test_one_verify_step_equals_plain_decode_steps(with_other_decode):
    torch.manual_seed(0)
    layer = PagedAttention(H, HKV, D, layer_idx=0)
    kv = torch.zeros(2, 16, BS, HKV, D)
    kv[:, :5] = torch.randn(2, 5, BS, HKV, D)  # request A: 18 tokens of context in blocks 0..4 (block 4 half used)
    kv[:, 8:10] = torch.randn(2, 2, BS, HKV, D)  # request B: 6 tokens in blocks 8, 9
    table_a = [0, 1, 2, 3, 4, 5, 0, 0]
    table_b = [8, 9, 10, 0, 0, 0, 0, 0]
    qkv = torch.randn(3, (H + 2 * HKV) * D)  # A's last token and two drafts
    cos_sin = torch.randn(3, 2, D // 2)
    qkv_b, cos_sin_b = torch.randn(1, (H + 2 * HKV) * D), torch.randn(1, 2, D // 2)

    plain_kv = kv.clone()
    plain = []
    for i in range(3):  # three decode steps at positions 18, 19, 20 (slots 4*4+2, 4*4+3, 5*4+0)
        pos = 18 + i
        slot = table_a[pos // BS] * BS + pos % BS
        md = _metadata([1], [pos + 1], [table_a], [slot])
        plain.append(_run(layer, plain_kv, md, qkv[i:i + 1], cos_sin[i:i + 1]))
    plain = torch.cat(plain)

    verify_kv = kv.clone()
    slots = [table_a[p // BS] * BS + p % BS for p in (18, 19, 20)]
    if with_other_decode:  # B decodes in the same step (position 6), before A in the batch
        md = _metadata([1, 3], [7, 21], [table_b, table_a], [9 * BS + 2, *slots], verify_reqs=[1])
        out = _run(layer, verify_kv, md, torch.cat([qkv_b, qkv]), torch.cat([cos_sin_b, cos_sin]))[1:]
        b_alone = _run(layer, kv.clone(), _metadata([1], [7], [table_b], [9 * BS + 2]), qkv_b, cos_sin_b)
        assert torch.equal(_run(layer, verify_kv.clone(), md, torch.cat([qkv_b, qkv]),
                                torch.cat([cos_sin_b, cos_sin]))[:1], b_alone)
    else:
        out = _run(layer, verify_kv, _metadata([3], [21], [table_a], slots, verify_reqs=[0]), qkv, cos_sin)
    assert torch.equal(out, plain)
    assert torch.equal(verify_kv[:, :6], plain_kv[:, :6])  # A's K/V written identically
