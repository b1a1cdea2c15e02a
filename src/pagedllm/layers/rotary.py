"""Rotary position embedding (Hugging Face's rotate-half layout) with Llama rope scaling.

Supported `rope_scaling` types: none/default, linear, llama3, longrope (Phi-3's; its legacy name "su" is read as
longrope by models/model_info.py); GGUF files may instead carry explicit per-frequency divisors (llama.cpp's
`rope_freqs` tensor), passed as `freq_factors`.

Partial rotary (`rotary_dim` < head_dim, e.g. Phi-4-mini's partial_rotary_factor 0.75): the table still has
head_dim / 2 frequencies, those past rotary_dim / 2 being 0 (cos 1, sin 0: those dimensions pass unchanged), so
every path that rotates with the table (the prefill path, the fused decode kernel, the native decode step) needs no
change. For that the checkpoint's q/k rows are reordered at load (models/checkpoint_tensors.py,
`partial_rotary_order`): transformers rotates pairs (i, i + rotary_dim / 2) of the first rotary_dim dimensions,
the full-width table pairs (i, i + head_dim / 2); q.k is unchanged by reordering q's and k's dimensions alike.

longrope: frequencies divided per frequency by `short_factor`, or by `long_factor` where the context served is longer
than `original_max_position_embeddings` (the loader sets `long_context` from max_model_len: `use_long_factors`),
cos and sin scaled by the attention factor (transformers' `_compute_longrope_parameters`). One set for every
position, so a token's K/V never depend on how long its sequence grows: vLLM's and llama.cpp's choice.
transformers instead switches a sequence to the long factors once it grows past the original context (recomputing
its cache), so the two agree on every sequence while the context served fits the original one, and on sequences
longer than it where it does not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pagedllm.kernels import cpu_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None,
                  freq_factors: Sequence[float] | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32, as transformers computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type == "longrope":
        inv_freq = longrope_inv_freq(head_dim, theta,
                                     scaling["long_factor" if scaling.get("long_context") else "short_factor"])
    elif rope_type != "default":
        raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: {SUPPORTED_ROPE_TYPES})")
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(list(freq_factors), dtype=torch.float32)
    return inv_freq


def longrope_inv_freq(dim: int, theta: float, factors: Sequence[float]) -> torch.Tensor:
    """[dim // 2] float32, rounded as transformers rounds it: 1 / (factor * theta ** (2i / dim))."""
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(list(factors), dtype=torch.float32) * theta ** shape)


def use_long_factors(scaling: dict[str, Any] | None, context: int) -> dict[str, Any] | None:
    """`scaling` with longrope's choice of factors for a served context of `context` tokens (others unchanged)."""
    if (scaling or {}).get("rope_type") != "longrope":
        return scaling
    return {**scaling, "long_context": context > scaling["original_max_position_embeddings"]}


def longrope_attention_factor(scaling: dict[str, Any]) -> float:
    """cos and sin's scale under longrope: `attention_factor`, else from the context's growth over the original one
    (`factor`, else max_position_embeddings / original_max_position_embeddings), as transformers computes it."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin table indexed by position; one lookup per forward, shared by all layers.

    The model is built on the meta device, so the table is computed by `materialize(device)` after
    the weights are loaded, not at init. `rotary_dim` (None: head_dim): the dimensions rotated, the rest of the
    table's frequencies 0 (see the module docstring).
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None, freq_factors: Sequence[float] | None = None,
                 rotary_dim: int | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.freq_factors = freq_factors
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)  # [max_positions, 2, D / 2]

    def materialize(self, device: torch.device) -> None:
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(self.rotary_dim, self.theta, self.scaling, self.freq_factors)  # [R / 2]
            positions = torch.arange(self.max_positions, dtype=torch.float32)  # [P]
            freqs = positions[:, None] * inv_freq[None, :]  # [P, R / 2]
            cos, sin = freqs.cos(), freqs.sin()
            if (self.scaling or {}).get("rope_type") == "longrope":
                scale = longrope_attention_factor(self.scaling)
                cos, sin = cos * scale, sin * scale
            if self.rotary_dim < self.head_dim:  # the dimensions past rotary_dim pass unchanged
                rest = self.head_dim // 2 - self.rotary_dim // 2
                cos = torch.cat([cos, cos.new_ones(self.max_positions, rest)], dim=1)
                sin = torch.cat([sin, sin.new_zeros(self.max_positions, rest)], dim=1)
            self.cos_sin = torch.stack([cos, sin], dim=1).to(device)  # [P, 2, D / 2]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # positions: [T] -> cos_sin: [T, 2, D / 2] in `dtype`, contiguous (this step's rows of the table)
        return self.cos_sin.index_select(0, positions).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos, sin: [T, 1, D / 2] -> [T, heads, D]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def apply_rotary_qkv(qkv: torch.Tensor, cos_sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                     head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a fused qkv projection into heads and rotate q and k.

    qkv: [T, (H + 2 * Hkv) * D]; cos_sin: [T, 2, D / 2] (RotaryEmbedding's output) -> q [T, H, D], k [T, Hkv, D],
    v [T, Hkv, D]. On the CPU in fp32 the native kernel rotates q and k in place in qkv, one pass, and q, k, v
    are views of it (rows strided by (H + 2 * Hkv) * D); elsewhere q and k are new tensors.
    """
    native = (qkv.dtype == torch.float32 and cos_sin.dtype == torch.float32 and qkv.is_contiguous()
              and cos_sin.is_contiguous() and cpu_kernels.available(qkv.dtype, qkv.device))
    if native:
        cpu_kernels.rotary_qkv(qkv, cos_sin, num_heads, num_kv_heads, head_dim)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(-1, num_heads, head_dim)  # [T, H, D]
    k = k.view(-1, num_kv_heads, head_dim)  # [T, Hkv, D]
    v = v.view(-1, num_kv_heads, head_dim)  # [T, Hkv, D]
    if not native:
        cos, sin = cos_sin[:, 0:1], cos_sin[:, 1:2]  # [T, 1, D / 2]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    return q, k, v
