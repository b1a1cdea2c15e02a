"""`--calculate-kv-scales`: per-layer K and V scales of an fp8 KV cache, calculated once at load.

vLLM calculates `k_scale = amax(K) / 200` and `v_scale = amax(V) / 100` (its K_SCALE_CONSTANT and V_SCALE_CONSTANT)
per attention layer from the first batch it runs. Here the batch is a fixed calibration text shipped with the
package (`kv_scale_calibration.txt`: prose, dialogue, code, numbers), run once through the model at load with a
model-dtype cache, so the scales are the same for every request and every run (DESIGN invariant 2: a request's
tokens must not depend on which requests happened to run first). Each scale is rounded up to a power of two
(layers/kv_cache_dtype.py: exact scaling, folded into the attention), so the calibration text's largest K value is
stored at 100-200 and V at 50-100: e4m3 saturates at 448, so K values up to 2.2x (V 4.5x) the calibration's largest
still fit.

The same pass also sets how K is rounded (measured: with 3 mantissa bits, e4m3's rounding error, not its range, is
what moves the logprobs, and K's error most). Scores are q . k, and the queries of a head point mostly in a few
directions (their second moment H's top eigenvector holds ~2/3 of the energy in SmolLM2-135M), so K rows are rounded
with error feedback in GPTQ's way (kernels/kv_dtype_cpu.h's kv_store_row_compensated): each value's rounding error is
carried into the values after it, weighted so that e^T H e stays small, i.e. the errors cancel along those
directions. Only the write changes; the codes are still plain e4m3 values read as before.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from pagedllm.distributed.pipeline_parallel import PipelineParallelGroup, run_stage
from pagedllm.layers.attention import PagedAttention
from pagedllm.layers.forward_context import AttentionMetadata, kv_cache_shape, set_forward_context
from pagedllm.layers.kv_cache_dtype import power_of_two_scale
from pagedllm.math_utils import cdiv

CALIBRATION_TEXT = Path(__file__).with_name("kv_scale_calibration.txt")
K_SCALE_CONSTANT = 200.0  # vLLM's: amax(K) / k_scale
V_SCALE_CONSTANT = 100.0
BLOCK_SIZE = 16
DAMPING = 0.01  # H + DAMPING * mean(diag H) * I: GPTQ's damping, keeps H invertible


def attention_layers(model: nn.Module) -> list[PagedAttention]:
    """The model's attention layers, by layer index."""
    return sorted((m for m in model.modules() if isinstance(m, PagedAttention)), key=lambda m: m.layer_idx)


@torch.inference_mode()
def calibrate(model: nn.Module, token_ids: list[int], device: torch.device, dtype: torch.dtype,
              pp: PipelineParallelGroup | None = None) -> list[tuple[float, float, torch.Tensor]]:
    """(max |K|, max |V|, queries' second moment H [Hkv, D, D] float64) per attention layer over one prefill of
    token_ids (K and the queries after rotary, as attention sees them). Resets every layer's scales and rounding.
    A pipeline stage (`pp`, every stage at once) runs its layers on the previous stage's output."""
    layers = attention_layers(model)
    moments: list[torch.Tensor] = []
    for a in layers:  # the values as computed (the cache holds the model dtype)
        a.k_scale = a.v_scale = 1.0
        a.k_comp = None

        def record(q, *args, layer=a, attend=a._attend):  # q: [T, H, D] -> [Hkv, D, D]
            g = q.double().view(q.shape[0], layer.num_kv_heads, -1, layer.head_dim).transpose(0, 1)
            g = g.reshape(layer.num_kv_heads, -1, layer.head_dim)
            moments.append(g.transpose(1, 2) @ g / g.shape[1])
            return attend(q, *args)

        a._attend = record  # this instance only, for this pass
    t = len(token_ids)
    num_blocks = cdiv(t, BLOCK_SIZE)
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
    try:
        input_ids, positions = torch.tensor(token_ids, dtype=torch.int64, device=device), torch.arange(t, device=device)
        with set_forward_context(metadata, caches):
            if pp is not None and pp.size > 1:
                run_stage(model, pp, input_ids, positions, dtype)
            else:
                model(input_ids, positions)
    finally:
        for a in layers:
            del a._attend
    return [(float(c[0].abs().amax()), float(c[1].abs().amax()), h) for c, h in zip(caches, moments, strict=True)]


def error_feedback_weights(h: torch.Tensor) -> torch.Tensor:
    """GPTQ's carry weights for second moments h [Hkv, D, D]: w = U / diag(U) row-wise, U the upper Cholesky factor
    of (h + damping)^-1; [Hkv, D, D] float32 (kv_store_row_compensated reads w[i][j] for j > i)."""
    d = h.shape[-1]
    damp = DAMPING * h.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None] * torch.eye(d, dtype=h.dtype, device=h.device)
    u = torch.linalg.cholesky(torch.linalg.inv(h + damp), upper=True)
    return (u / u.diagonal(dim1=-2, dim2=-1)[..., None]).float().contiguous()


def calculate_kv_scales(model: nn.Module, token_ids: list[int], device: torch.device, dtype: torch.dtype,
                        pp: PipelineParallelGroup | None = None) -> list[tuple[float, float]]:
    """Set every attention layer's k_scale, v_scale and K rounding (k_comp) from one prefill of token_ids; returns
    the scales per layer (this stage's layers with `pp`)."""
    stats = calibrate(model, token_ids, device, dtype, pp)
    scales = [(power_of_two_scale(k, K_SCALE_CONSTANT), power_of_two_scale(v, V_SCALE_CONSTANT)) for k, v, _ in stats]
    for layer, (k_scale, v_scale), (_, _, h) in zip(attention_layers(model), scales, stats, strict=True):
        layer.k_scale, layer.v_scale = k_scale, v_scale
        layer.k_comp = error_feedback_weights(h.to(device))
    return scales
