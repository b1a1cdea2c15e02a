"""Slice checkpoint tensors to one tensor-parallel rank's share, before they are fused and packed.

A model's `tensor_parallel_plan` maps a checkpoint name fragment to how its weight is cut:

    q_heads   rows of this rank's query heads           (column-parallel: q_proj)
    kv_heads  rows of this rank's KV heads, one head replicated when the size exceeds them (k_proj, v_proj)
    out       rows, evenly                              (column-parallel: gate_proj, up_proj)
    in        columns, evenly; a bias stays on rank 0 only, as the all-reduce sums it once (o_proj, down_proj)
    vocab     rows of this rank's vocabulary slice, zero-padded to cdiv(vocab, size) (embed_tokens, lm_head)
    whole     the whole tensor (an expert of this rank's under expert parallelism: models/expert_weights.py)

Weights kept quantized (QuantizedWeight, a GGUF model) are cut the same way: whole rows, or whole groups of
k's (a column cut that does not fall on a group boundary is a ValueError).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.models.model_info import ModelInfo, ModelLoadError
from pagedllm.models.quantized_codes import QuantizedWeight


def shard_tensors(tensors: Iterator[tuple[str, Any]], plan: dict[str, str], info: ModelInfo,
                  tp: TensorParallelGroup) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors, each cut to this rank's share per `plan` (the others pass unchanged)."""
    for name, t in tensors:
        kind = next((k for part, k in plan.items() if f".{part}." in f".{name}"), None)
        if kind is not None:
            try:
                t = _shard(t, kind, name.endswith(".bias"), info, tp)
            except ValueError as e:
                raise ModelLoadError(f"{name}: {e}") from None
        yield name, t


def _shard(t: Any, kind: str, is_bias: bool, info: ModelInfo, tp: TensorParallelGroup) -> Any:
    d = info.head_dim
    if kind == "q_heads":
        start, end = tp.split(info.num_heads)
        return _rows(t, start * d, end * d)
    if kind == "kv_heads":
        start, end = tp.kv_heads(info.num_kv_heads)
        return _rows(t, start * d, end * d)
    if kind == "out":
        return _rows(t, *tp.split(t.shape[0]))
    if kind == "in":
        if is_bias:
            return t if tp.rank == 0 else _zeros_like(t)
        return _columns(t, *tp.split(t.shape[1]))
    if kind == "whole":
        return t
    if kind == "vocab":
        start, end = tp.padded_split(info.vocab_size)
        return _pad_rows(_rows(t, start, min(end, t.shape[0])), end - start)
    raise ValueError(f"unknown tensor-parallel slicing {kind!r}")


def _rows(t: Any, start: int, end: int) -> Any:
    if isinstance(t, QuantizedWeight):
        return t.map_rows(lambda a: a[start:end])
    return t[start:end]


def _columns(t: Any, start: int, end: int) -> Any:
    if isinstance(t, QuantizedWeight):
        if start % t.group or end % t.group:
            raise ValueError(f"columns [{start}, {end}) do not fall on its quantization groups of {t.group}")
        g0, g1 = start // t.group, end // t.group
        return QuantizedWeight(t.codes[:, start:end], t.scales[:, g0:g1], t.offsets[:, g0:g1], t.group, t.bits,
                               t.qtypes)
    return t[:, start:end]


def _pad_rows(t: Any, n: int) -> Any:
    """t with zero rows appended up to n rows (a quantized zero row: codes, scales and offsets 0)."""
    pad = n - t.shape[0]
    if pad <= 0:
        return t
    if isinstance(t, QuantizedWeight):
        return t.map_rows(lambda a: np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]))
    if isinstance(t, np.ndarray):
        return np.concatenate([t, np.zeros((pad, *t.shape[1:]), t.dtype)])
    return torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])


def _zeros_like(t: Any) -> Any:
    return np.zeros_like(t) if isinstance(t, np.ndarray) else torch.zeros_like(t)
