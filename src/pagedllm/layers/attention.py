"""Paged attention over a flattened batch that mixes prefill chunks and decodes.

Per call, from the fused qkv projection: (1) rotary on q and k; (2) write this step's K/V into the cache at
`slot_mapping` (in the cache's dtype, divided by the layer's k_scale / v_scale: layers/kv_cache_dtype.py); (3) each
query attends to its request's cached tokens, read through the block table, plus the causal part of its own chunk
(k_scale folded into the softmax scale, v_scale into the output). When every row is a decode and the native kernel
runs, (1) to (3) are one call per layer (`cpu_kernels.fused_decode_attention`).

Plan, built once per step (`AttentionMetadata.plan`) and reused by every layer:
- decode rows (query length 1) are batched. On the CPU in fp32 the native kernel
  (`kernels/paged_attention_cpu.c`) reads each request's blocks in place through the block table, K and V
  once each, converting bf16 / fp8 values in registers. Elsewhere only the blocks each one needs are
  gathered with one `index_select` over whole blocks (contiguous block_size-token rows, a memcpy each), then
  one SDPA call with the query heads of each KV group as its query rows ([B, kv_heads, group, D]) and a
  length mask for the partly used last block;
- rows that verify draft tokens (speculative decoding, `AttentionMetadata.verify_reqs`) are decode rows too, each
  with its own context length over its request's block table; every K/V of the step is written first, then the
  rows attend (the fused call, which writes and attends row by row in parallel, is not used for such a step),
  so a verified token's output is the same as plain decoding's. Natively, a request's rows run together in the
  multi-row kernel (`kernels/multirow_attention.py`: each K/V row read once per tile of rows, every row bitwise
  the decode kernel's for its length);
- natively (fp32 activations on the CPU, any KV cache dtype the kernels read), a step with a prefill chunk or a
  verify row writes every K/V first, then runs every row of the step through the multi-row kernel
  (`kernels/multirow_attention.py`): a request's rows together, each row exactly a decode row of its position
  (causal: the row at position p sees tokens 0..p), bit for bit. So a row's bits do not depend on how its prompt
  was chunked, on a prefix cache hit, or on whether it was prefilled or decoded. Faster than the matmul path
  below at every shape measured (SmolLM2, CPU time at 1 thread: an 8 x 256-token prefill step's attention 2x,
  one 2,048-token chunk 2x; at 2 threads on a busy machine 4x and 2.7x): it computes only the causal half and
  reads each K/V row once per tile of 16 rows;
- elsewhere (CUDA, other activation dtypes) prefill chunks run one request at a time; a chunk with no cached prefix
  reads its own K/V directly (no cache read at all) when the cache holds the model dtype. A cache of another dtype
  (`--kv-cache-dtype`) is always read back (`.to` the model dtype), own chunk included, so a token's K/V are the
  same stored values whether they came from this chunk, an earlier one or the prefix cache (DESIGN invariant 2
  within a KV dtype). Where the scores fit in `GROUPED_SCORES_MAX_BYTES`, it is two batched matmuls per KV group
  (its query heads stacked as rows, an additive causal mask built once per step): 2.7x faster than SDPA with
  enable_gqa for a 256-token prompt on the CPU, which falls back to its unfused math path for GQA. Longer chunks go
  through SDPA, whose memory does not grow with the square of the chunk.

Per-layer options (`PagedAttention(sliding_window=, logit_softcap=, scale=)`, set by a family: Mistral, Gemma 2): a
sliding window (the query at position p attends the keys at positions > p - window, transformers' and vLLM's
definition), attention logit soft-capping (softcap * tanh(scores / softcap) on the scaled scores, before the mask
and the softmax) and the softmax scale. The native kernels take them as arguments (a windowed layer's rows of a
prefill or verify step run one by one through the decode kernel's per-row code, so they stay bitwise its decode
rows); elsewhere such a layer runs the explicit math below (scores, cap, mask, softmax), never SDPA, whose masks
and scales could express the window but not the cap. A layer without options runs exactly the paths above. The KV
cache of a windowed layer is managed by the hybrid manager (core/kv_cache_coordinator.py): blocks before the window
are freed, and their table slots hold the null block or a stale id, which every path above skips (native kernels) or
masks (torch paths) as outside the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu_kernels
from pagedllm.kernels.multirow_attention import check_multirow_args, paged_multirow_attention
from pagedllm.layers.forward_context import AttentionMetadata, get_forward_context
from pagedllm.layers.kv_cache_dtype import index_copy, to_cache_dtype, to_cache_dtype_compensated
from pagedllm.layers.rotary import apply_rotary_qkv
from pagedllm.math_utils import cdiv

GROUPED_SCORES_MAX_BYTES = 64 << 20  # scores [Hkv, G * Tq, seq_len] above this go through SDPA


@dataclass
class _Prefill:
    start: int  # first row of the chunk in the flattened batch
    end: int
    seq_len: int  # context after this step; the chunk is the last end - start tokens
    block_ids: torch.Tensor | None  # [ceil(seq_len / block_size)] int64; None: no cached prefix
    bias: torch.Tensor | None = None  # [G * Tq, seq_len] 0 / -inf causal mask (grouped path), built lazily


@dataclass
class _AttentionPlan:
    native: bool  # the native kernels write the cache and run the decode rows
    all_decode: bool  # every row a decode, in order (the decode rows are the whole batch)
    has_verify: bool  # some decode rows verify drafts: every K/V of the step is written before any row attends
    decode_rows: torch.Tensor | None  # [B] int64 rows of single-token queries
    decode_block_table: torch.Tensor | None  # [B, nb] int32 (native kernel)
    decode_seq_lens: torch.Tensor | None  # [B] int32 (native kernel)
    decode_block_ids: torch.Tensor | None  # [B * nb] int64, row-major over (request, block) (torch path)
    decode_num_blocks: int  # nb: blocks read per decode request
    decode_mask: torch.Tensor | None  # [B, 1, 1, nb * block_size] bool, True = attend (torch path)
    prefills: list[_Prefill]
    decode_lens: torch.Tensor | None = None  # [B] int64 context lengths (torch path: a windowed layer's mask)
    # The native multi-row kernel over every row of the step, each request a group of rows (None: not used)
    rows_block_table: torch.Tensor | None = None  # [R, nb] int32: each request's table
    rows_start: torch.Tensor | None = None  # [R + 1] int64: query_start_loc
    rows_seq_lens: torch.Tensor | None = None  # [T] int32: each row's context length (its position + 1)


def build_plan(md: AttentionMetadata, block_size: int, native: bool, always_read_cache: bool = False) -> _AttentionPlan:
    """Split the batch into decode rows and prefill chunks (host-side numpy, once per step).

    native: the decode rows run the native kernel (block table and lengths) instead of gather + SDPA.
    always_read_cache: prefill chunks read their whole context from the cache, their own tokens included."""
    qsl = np.asarray(md.query_start_loc_cpu, dtype=np.int64)  # [R + 1]
    seq_lens = np.asarray(md.seq_lens_cpu, dtype=np.int64)  # [R]
    query_lens = qsl[1:] - qsl[:-1]  # [R]
    device = md.block_table.device
    is_decode = query_lens == 1
    has_verify = md.verify_reqs is not None and len(md.verify_reqs) > 0
    if has_verify:
        is_decode[md.verify_reqs] = True
    if native and not is_decode.all():  # every row through the multi-row kernel; no other field is read
        plan = _AttentionPlan(native, False, has_verify, None, None, None, None, 0, None, [])
        _plan_rows(plan, md.block_table, qsl, seq_lens, block_size)
        return plan
    decode_reqs = np.nonzero(is_decode)[0]
    decode_rows = decode_block_table = decode_seq_lens = decode_block_ids = decode_mask = None
    nb = 0
    if len(decode_reqs):
        # One entry per decode row, in batch order: a verify request's q rows get context lengths L - q + 1 .. L.
        # E.g. query_lens [1, 3], seq_lens [9, 20]: rows [0, 1, 2, 3], requests [0, 1, 1, 1], lens [9, 18, 19, 20].
        counts = query_lens[decode_reqs]
        row_req = np.repeat(decode_reqs, counts)  # [B]
        row_offset = np.arange(len(row_req)) - np.repeat(np.cumsum(counts) - counts, counts)
        row_lens = seq_lens[row_req] - counts.repeat(counts) + 1 + row_offset  # [B]
        req_idx = torch.from_numpy(row_req).to(device)
        decode_rows = torch.from_numpy(qsl[row_req] + row_offset).to(device)
        nb = int(cdiv(seq_lens[decode_reqs].max(), block_size))
        lens = torch.from_numpy(row_lens).to(device)  # [B]
        if native:
            decode_block_table = md.block_table[req_idx, :nb].to(torch.int32).contiguous()  # [B, nb]
            decode_seq_lens = lens.to(torch.int32)
        else:
            decode_block_ids = md.block_table[req_idx, :nb].reshape(-1).long()  # [B * nb]
            key_pos = torch.arange(nb * block_size, device=device)  # [L]
            decode_mask = (key_pos[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    prefills = []
    for r in np.nonzero(~is_decode)[0]:
        start, end, seq_len = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
        block_ids = None
        if seq_len > end - start or always_read_cache:
            block_ids = md.block_table[r, : cdiv(seq_len, block_size)].long()
        prefills.append(_Prefill(start, end, seq_len, block_ids))
    all_decode = decode_rows is not None and not prefills
    plan = _AttentionPlan(native, all_decode, has_verify, decode_rows, decode_block_table, decode_seq_lens,
                          decode_block_ids, nb, decode_mask, prefills,
                          decode_lens=lens if decode_mask is not None else None)
    if native and has_verify:  # the native decode step reads decode_seq_lens and the rows' fields
        _plan_rows(plan, md.block_table, qsl, seq_lens, block_size)
    return plan


def _plan_rows(plan: _AttentionPlan, block_table: torch.Tensor, qsl: np.ndarray, seq_lens: np.ndarray,
               block_size: int) -> None:
    """Every row of the step through the multi-row kernel: request r's rows are a group over its block table,
    the row at position p (of a chunk or of a verify step's rows) a decode row of length p + 1."""
    query_lens = qsl[1:] - qsl[:-1]  # [R]
    row_req = np.repeat(np.arange(len(query_lens)), query_lens)  # [T]
    row_lens = seq_lens[row_req] - query_lens[row_req] + 1 + np.arange(len(row_req)) - qsl[row_req]
    nb = int(cdiv(seq_lens.max(), block_size))
    plan.rows_block_table = block_table[: len(query_lens), :nb].to(torch.int32).contiguous()
    plan.rows_start = torch.from_numpy(qsl.copy())
    plan.rows_seq_lens = torch.from_numpy(row_lens.astype(np.int32))


def step_plan(md: AttentionMetadata, kv_cache: torch.Tensor, dtype: torch.dtype,
              device: torch.device) -> _AttentionPlan:
    """This step's plan (`md.plan`), built by the first caller of the step and shared by every layer (and by the
    native decode step, models/llama_native_step.py). kv_cache: any layer's (they share dtype and shape);
    dtype, device: the activations'."""
    plan: _AttentionPlan | None = md.plan
    if plan is None:
        plan = md.plan = build_plan(md, kv_cache.shape[2], cpu_kernels.kv_cache_native(kv_cache.dtype, dtype, device),
                                    always_read_cache=kv_cache.dtype != dtype)
        if plan.native and plan.decode_rows is not None:  # once per step, not per layer
            cpu_kernels.check_decode_args(kv_cache[0], kv_cache[1], plan.decode_block_table, plan.decode_seq_lens)
        if plan.rows_start is not None:
            check_multirow_args(kv_cache[0], kv_cache[1], plan.rows_block_table, plan.rows_start, plan.rows_seq_lens)
    return plan


class PagedAttention(nn.Module):
    """Attention for one layer; its KV cache is `get_forward_context().kv_caches[layer_idx]`."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 sliding_window: int | None = None, logit_softcap: float | None = None, scale: float | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self.scale = head_dim**-0.5 if scale is None else float(scale)
        self.window = int(sliding_window or 0)  # 0: full causal attention
        self.softcap = float(logit_softcap or 0.0)  # 0.0: no soft-capping
        self.has_options = self.window > 0 or self.softcap > 0.0  # the torch paths run _masked_attention
        # vLLM's k_scale / v_scale: a cached K code c stands for c * k_scale (powers of two; 1.0 unless set at load
        # for an fp8 cache, layers/kv_cache_dtype.py). Folded into the softmax scale and the output, never applied
        # value by value.
        self.k_scale = 1.0
        self.v_scale = 1.0
        # None, or (fp8 cache, set at load with the scales) [Hkv, D, D] float32 error-feedback weights K rows are
        # rounded with (kv_cache_dtype.to_cache_dtype_compensated); reading is unchanged.
        self.k_comp: torch.Tensor | None = None

    def forward(self, qkv: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        # qkv: [T, (H + 2 * Hkv) * D], the fused projection before rotary; cos_sin: [T, 2, D / 2] -> out [T, H * D]
        ctx = get_forward_context()
        md = ctx.attn_metadata if ctx.layer_attn_metadata is None else ctx.layer_attn_metadata[self.layer_idx]
        kv_cache = ctx.kv_caches[self.layer_idx]  # [2, num_blocks, block_size, Hkv, D]
        num_padded, n = qkv.shape[0], md.num_actual_tokens
        plan = step_plan(md, kv_cache, qkv.dtype, qkv.device)
        fused = plan.native and plan.all_decode and not plan.has_verify
        if fused and qkv.is_contiguous() and cos_sin.is_contiguous():  # one native call
            if num_padded > n:
                qkv, cos_sin = qkv[:n], cos_sin[:n]
            out = cpu_kernels.fused_decode_attention(qkv, cos_sin, md.slot_mapping, kv_cache, plan.decode_block_table,
                                                     plan.decode_seq_lens, self.scale, self.num_heads, self.k_scale,
                                                     self.v_scale, self.k_comp, self.window, self.softcap)
        else:
            out = self._attend(*apply_rotary_qkv(qkv[:n], cos_sin[:n], self.num_heads, self.num_kv_heads,
                                                 self.head_dim), kv_cache, md.slot_mapping[:n], plan)
        out = out.view(n, self.num_heads * self.head_dim)
        if num_padded > n:  # rows past num_actual_tokens (padding) get zeros
            out = torch.cat([out, out.new_zeros(num_padded - n, out.shape[1])])
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                plan: _AttentionPlan) -> torch.Tensor:
        # q: [n, H, D]; k, v: [n, Hkv, D] -> [n, H, D]
        if plan.native and (k.stride()[1:] != (self.head_dim, 1) or v.stride() != k.stride()):
            k, v = k.contiguous(), v.contiguous()  # the kernels take K and V rows with one shared stride
        self._write(k, v, kv_cache, slots, plan.native)
        if plan.rows_start is not None:  # every K/V of the step written: each row attends as a decode row
            return paged_multirow_attention(q, kv_cache[0], kv_cache[1], plan.rows_block_table, plan.rows_start,
                                            plan.rows_seq_lens, self.scale, self.k_scale, self.v_scale,
                                            args_checked=True, window=self.window, softcap=self.softcap)
        if plan.all_decode:
            return self._decode(q, kv_cache, plan)
        out = q.new_empty(q.shape[0], self.num_heads, self.head_dim)  # [n, H, D]
        if plan.decode_rows is not None:
            out[plan.decode_rows] = self._decode(q.index_select(0, plan.decode_rows), kv_cache, plan)
        for p in plan.prefills:
            out[p.start : p.end] = self._prefill(q[p.start : p.end], k[p.start : p.end], v[p.start : p.end],
                                                 kv_cache, p)
        return out

    def _write(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
               native: bool) -> None:
        # k, v: [T, Hkv, D] -> the cache's slots, in its dtype
        if native:
            cpu_kernels.write_kv_cache(k, v, kv_cache[0], kv_cache[1], slots, self.k_scale, self.v_scale, self.k_comp)
            return
        shape = (kv_cache.shape[1] * kv_cache.shape[2], self.num_kv_heads, self.head_dim)  # [num_slots, Hkv, D]
        if self.k_comp is not None:
            k_codes = to_cache_dtype_compensated(k, kv_cache.dtype, self.k_scale, self.k_comp)
        else:
            k_codes = to_cache_dtype(k, kv_cache.dtype, self.k_scale)
        index_copy(kv_cache[0].view(shape), slots, k_codes)
        index_copy(kv_cache[1].view(shape), slots, to_cache_dtype(v, kv_cache.dtype, self.v_scale))

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, plan: _AttentionPlan) -> torch.Tensor:
        # q: [B, H, D] -> [B, H, D]
        if plan.native:
            return cpu_kernels.paged_decode_attention(q, kv_cache[0], kv_cache[1], plan.decode_block_table,
                                                      plan.decode_seq_lens, self.scale, self.k_scale, self.v_scale,
                                                      self.window, self.softcap)
        b = q.shape[0]
        hkv, d = self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        blocks = kv_cache.view(2, kv_cache.shape[1], -1)  # [2, num_blocks, block_size * Hkv * D]
        length = plan.decode_num_blocks * kv_cache.shape[2]
        keys = blocks[0].index_select(0, plan.decode_block_ids).view(b, length, hkv, d)
        values = blocks[1].index_select(0, plan.decode_block_ids).view(b, length, hkv, d)
        if self.has_options:
            key_pos = torch.arange(length, device=q.device)  # [L]
            visible = key_pos[None, :] < plan.decode_lens[:, None]  # [B, L]: the query sits at position len - 1
            out = torch.stack([self._masked_attention(q[i].unsqueeze(0), keys[i].to(q.dtype), values[i].to(q.dtype),
                                                      visible[i : i + 1], plan.decode_lens[i : i + 1] - 1,
                                                      self.k_scale, self.v_scale) for i in range(b)])
            return out.view(b, self.num_heads, d)
        # The group's queries share one mask, so they ride in SDPA's query-length dimension: one
        # [G, D] x [D, L] product per (request, KV head), no GQA expansion of K/V (measured fastest).
        qg = q.view(b, hkv, group, d)  # [B, Hkv, G, D]
        out = F.scaled_dot_product_attention(
            qg, keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
            attn_mask=plan.decode_mask, scale=self.scale * self.k_scale)  # [B, Hkv, G, D]
        if self.v_scale != 1.0:
            out = out * self.v_scale
        return out.reshape(b, self.num_heads, d)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 p: _Prefill) -> torch.Tensor:
        # q: [Tq, H, D]; k, v: [Tq, Hkv, D] (this chunk) -> [Tq, H, D]
        tq = q.shape[0]
        k_scale = v_scale = 1.0  # this chunk's own K/V as computed: unscaled
        if p.block_ids is not None:  # a cached prefix: keys and values are the request's whole context
            blocks = kv_cache.view(2, kv_cache.shape[1], -1)
            shape = (-1, self.num_kv_heads, self.head_dim)
            k = blocks[0].index_select(0, p.block_ids).view(shape)[: p.seq_len]  # [L, Hkv, D]
            v = blocks[1].index_select(0, p.block_ids).view(shape)[: p.seq_len]
            k_scale, v_scale = self.k_scale, self.v_scale
        k, v = k.to(q.dtype), v.to(q.dtype)
        if self.has_options:
            query_pos = torch.arange(p.seq_len - tq, p.seq_len, device=q.device)  # [Tq]
            visible = torch.arange(p.seq_len, device=q.device)[None, :] <= query_pos[:, None]  # [Tq, L]
            return self._masked_attention(q, k, v, visible, query_pos, k_scale, v_scale)
        hkv, d = self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        if hkv * group * tq * p.seq_len * q.element_size() > GROUPED_SCORES_MAX_BYTES:
            # Query i sits at position seq_len - tq + i and sees keys 0 ..= that position.
            query_pos = torch.arange(p.seq_len - tq, p.seq_len, device=q.device)  # [Tq]
            mask = torch.arange(p.seq_len, device=q.device)[None, :] <= query_pos[:, None]  # [Tq, L]
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=self.scale * k_scale,
                enable_gqa=True)  # [H, Tq, D]
            return (out * v_scale if v_scale != 1.0 else out).transpose(0, 1)
        if p.bias is None:  # the same for every layer of this step
            query_pos = torch.arange(p.seq_len - tq, p.seq_len, device=q.device)  # [Tq]
            visible = torch.arange(p.seq_len, device=q.device)[None, :] <= query_pos[:, None]  # [Tq, L]
            bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
            p.bias = bias.repeat(group, 1)  # [G * Tq, L]: rows g * Tq + i
        qg = q.view(tq, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * tq, d)  # [Hkv, G * Tq, D]
        scores = torch.baddbmm(p.bias, qg, k.permute(1, 2, 0), alpha=self.scale * k_scale)  # [Hkv, G * Tq, L]
        out = torch.bmm(scores.softmax(dim=-1), v.transpose(0, 1))  # [Hkv, G * Tq, D]
        if v_scale != 1.0:
            out *= v_scale
        return out.view(hkv, group, tq, d).permute(2, 0, 1, 3).reshape(tq, self.num_heads, d)

    def _masked_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                          query_pos: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
        """The explicit math of a layer with options (torch paths): scaled scores, soft-capped, the causal mask
        (`visible`) narrowed to the window, softmax, values.

        q: [Tq, H, D]; k, v: [L, Hkv, D] in q's dtype; visible: [Tq, L] bool, causal (True = attend);
        query_pos: [Tq] int64, each query's position -> [Tq, H, D]."""
        tq, hkv, d = q.shape[0], self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        if self.window > 0:  # keys at positions > p - window
            key_pos = torch.arange(k.shape[0], device=q.device)
            visible = visible & (key_pos[None, :] > query_pos[:, None] - self.window)
        qg = q.view(tq, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * tq, d)  # [Hkv, G * Tq, D]
        scores = torch.bmm(qg, k.permute(1, 2, 0)) * (self.scale * k_scale)  # [Hkv, G * Tq, L]
        if self.softcap > 0.0:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.masked_fill(~visible.repeat(group, 1), float("-inf"))  # rows g * Tq + i
        out = torch.bmm(scores.softmax(dim=-1), v.transpose(0, 1))  # [Hkv, G * Tq, D]
        if v_scale != 1.0:
            out *= v_scale
        return out.view(hkv, group, tq, d).permute(2, 0, 1, 3).reshape(tq, self.num_heads, d)
