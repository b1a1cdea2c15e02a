"""`--calculate-kv-scales`: per-layer K and V scales of an fp8 KV cache, calculated once at load.

vLLM calculates `k_scale = amax(K) / 200` and `v_scale = amax(V) / 100` (its K_SCALE_CONSTANT and V_SCALE_CONSTANT)
per attention layer from the first batch it runs. Here the batch is a fixed calibration text shipped with the
package (`kv_scale_calibration.txt`: prose, dialogue, code, numbers), run once through the model at load with a
model-dtype cache, so the scales are the same for every request and every run (DESIGN invariant 2: a request's
tokens must not depend on which requests happened to run first). Each scale is rounded up to a power of two
(layers/kv_cache_dtype.py: exact scaling, folded into the attention), so the calibration text's largest K value is
stored at 100-200 and V at 50-100: e4m3 saturates at 448, so K values up to 2.2x (V 4.5x) the calibration's largest
still fit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from pagedllm.layers.attention import PagedAttention
from pagedllm.layers.forward_context import AttentionMetadata, kv_cache_shape, set_forward_context
from pagedllm.layers.kv_cache_dtype import power_of_two_scale

CALIBRATION_TEXT = Path(__file__).with_name("kv_scale_calibration.txt")
K_SCALE_CONSTANT = 200.0  # vLLM's: amax(K) / k_scale
V_SCALE_CONSTANT = 100.0
BLOCK_SIZE = 16


def attention_layers(model: nn.Module) -> list[PagedAttention]:
    """The model's attention layers, by layer index."""
    return sorted((m for m in model.modules() if isinstance(m, PagedAttention)), key=lambda m: m.layer_idx)


@torch.inference_mode()
def kv_amax(model: nn.Module, token_ids: list[int], device: torch.device,
            dtype: torch.dtype) -> list[tuple[float, float]]:
    """(max |K|, max |V|) per attention layer over one prefill of token_ids (K after rotary, as the cache holds it).
    Resets every layer's scales to 1.0."""
    layers = attention_layers(model)
    for a in layers:  # the values as computed (the cache holds the model dtype)
        a.k_scale = a.v_scale = 1.0
    t = len(token_ids)
    num_blocks = -(-t // BLOCK_SIZE)
    caches = [torch.zeros(kv_cache_shape(num_blocks, BLOCK_SIZE, a.num_kv_heads, a.head_dim), dtype=dtype,
                          device=device) for a in layers]
    query_start_loc, seq_lens = np.array([0, t], dtype=np.int64), np.array([t], dtype=np.int64)
    metadata = AttentionMetadata(
        num_actual_tokens=t, max_query_len=t, max_seq_len=t,
        query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([t], dtype=torch.int32, device=device),
        block_table=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        slot_mapping=torch.arange(t, dtype=torch.int64, device=device),
        query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens)
    with set_forward_context(metadata, caches):
        model(torch.tensor(token_ids, dtype=torch.int64, device=device), torch.arange(t, device=device))
    return [(float(c[0].abs().amax()), float(c[1].abs().amax())) for c in caches]


def calculate_kv_scales(model: nn.Module, token_ids: list[int], device: torch.device,
                        dtype: torch.dtype) -> list[tuple[float, float]]:
    """Set every attention layer's k_scale and v_scale from one prefill of token_ids; returns them per layer."""
    scales = [(power_of_two_scale(k, K_SCALE_CONSTANT), power_of_two_scale(v, V_SCALE_CONSTANT))
              for k, v in kv_amax(model, token_ids, device, dtype)]
    for layer, (k_scale, v_scale) in zip(attention_layers(model), scales, strict=True):
        layer.k_scale, layer.v_scale = k_scale, v_scale
    return scales
