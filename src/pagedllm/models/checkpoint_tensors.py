"""Checkpoint tensors put in the layout every family loads, before tensor-parallel slicing and fusing.

- Already-fused tensors (a model class's `fused_checkpoint_modules`, e.g. Phi-3's `qkv_proj` and `gate_up_proj`)
  are split into their parts (q / k / v by head counts, gate / up in halves), so that tensor parallelism slices
  them by heads and halves like separate ones (models/tensor_parallel_weights.py) and the loader fuses them back.
- With partial rotary (ModelInfo.rotary_dim < head_dim), each head's q and k rows are reordered
  (`partial_rotary_order`) so that the full-width rotary table, whose frequencies past rotary_dim / 2 are 0,
  rotates exactly the dimensions transformers rotates (layers/rotary.py).

Both work on torch tensors, numpy arrays and QuantizedWeight (whole rows: codes, scales and offsets alike).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from pagedllm.models.model_info import ModelInfo, ModelLoadError
from pagedllm.models.quantized_codes import QuantizedWeight


def prepare_checkpoint_tensors(tensors: Iterator[tuple[str, Any]], model_cls: type, info: ModelInfo
                               ) -> Iterator[tuple[str, Any]]:
    fused: dict[str, tuple[str, ...]] = getattr(model_cls, "fused_checkpoint_modules", {})
    if fused:
        tensors = _split_fused(tensors, fused, info)
    if info.rotary_dim is not None and info.rotary_dim < info.head_dim:
        tensors = _reorder_partial_rotary(tensors, info)
    return tensors


def _part_sizes(parts: tuple[str, ...], rows: int, info: ModelInfo) -> list[int]:
    if len(parts) == 3:  # q, k, v
        q, kv = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
        return [q, kv, kv] if rows == q + 2 * kv else []
    return [rows // len(parts)] * len(parts) if rows % len(parts) == 0 else []


def _split_fused(tensors: Iterator[tuple[str, Any]], fused: dict[str, tuple[str, ...]], info: ModelInfo
                 ) -> Iterator[tuple[str, Any]]:
    for name, t in tensors:
        fragment = next((f for f in fused if f".{f}." in name), None)
        if fragment is None:
            yield name, t
            continue
        parts = fused[fragment]
        sizes = _part_sizes(parts, t.shape[0], info)
        if not sizes:
            raise ModelLoadError(f"{name}: {t.shape[0]} rows cannot be split into {'/'.join(parts)} "
                                 f"({info.num_heads} heads, {info.num_kv_heads} KV heads of {info.head_dim})")
        start = 0
        for part, size in zip(parts, sizes, strict=True):
            yield name.replace(f".{fragment}.", f".{part}."), _rows(t, np.arange(start, start + size))
            start += size


def partial_rotary_order(head_dim: int, rotary_dim: int) -> np.ndarray:
    """Row order within a head [head_dim] (new row -> checkpoint row): transformers' rotated pairs (i, i + R/2)
    at (i, i + D/2), the passed dimensions in the remaining places."""
    half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return np.concatenate([np.arange(0, half), np.arange(rotary_dim, rotary_dim + rest),
                           np.arange(half, rotary_dim), np.arange(rotary_dim + rest, head_dim)])


def _reorder_partial_rotary(tensors: Iterator[tuple[str, Any]], info: ModelInfo) -> Iterator[tuple[str, Any]]:
    order = partial_rotary_order(info.head_dim, info.rotary_dim)
    for name, t in tensors:
        if ".q_proj." in name or ".k_proj." in name:
            heads = t.shape[0] // info.head_dim
            t = _rows(t, (np.arange(heads)[:, None] * info.head_dim + order[None, :]).reshape(-1))
        yield name, t


def _rows(t: Any, index: np.ndarray) -> Any:
    if isinstance(t, QuantizedWeight):
        return t.map_rows(lambda a: a[index])
    if isinstance(t, np.ndarray):
        return t[index]
    import torch

    return t.index_select(0, torch.from_numpy(index).to(t.device))
