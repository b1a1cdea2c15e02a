"""A mixture-of-experts checkpoint's expert weights, from the checkpoint's layout to the stacked one the model holds.

Every expert travels the loader as a dense MLP's weights would, under the names Qwen3-MoE's checkpoints use,
`model.layers.{i}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight` (a family renames its own to these:
models/mixtral.py), so that what applies to one linear applies to each expert: a GGUF weight kept quantized,
`--quantization fp8`, the tensor-parallel cut of its intermediate size, gate and up fused into `gate_up_proj`.
Under expert parallelism `local_experts` keeps only this rank's experts, which tensor parallelism then leaves whole
(EXPERT_PARALLEL_PLAN). Then `stack_experts` puts each layer's experts into the stacked weights of its ExpertLinears
(`mlp.experts.gate_up_proj.weight` [E, 2 * I, hidden], `mlp.experts.down_proj.weight` [E, hidden, I]: transformers'
layout), or, kept quantized, one QuantizedExperts of E matrices each.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers.expert_linear import ExpertLinear, QuantizedExperts, RunWeight
from pagedllm.layers.int8_activation_weight import Int8ActivationWeight
from pagedllm.layers.quantized_weight import PackedWeight
from pagedllm.models.model_info import ModelInfo, ModelLoadError

logger = logging.getLogger(__name__)
EXPERT_PARALLEL_PLAN = {"experts": "whole"}  # put before a model's tensor_parallel_plan: experts are not cut
_EXPERT_NAME = re.compile(r"model\.layers\.(\d+)\..*\.experts\.(\d+)\.")


def local_experts(tensors: Iterator[tuple[str, Any]], model_cls: type, info: ModelInfo, tp: TensorParallelGroup
                  ) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors less the experts of other ranks: rank r of n keeps experts [r * E / n,
    (r + 1) * E / n) of each mixture-of-experts layer (the FusedMoE's local experts)."""
    moe = next((o for i in range(info.num_layers) if (o := model_cls.moe_options(info, i))), None)
    if moe is not None:
        logger.info("expert parallel: rank %d of %d holds experts [%d, %d) of %d in each sparse layer", tp.rank,
                    tp.size, *tp.split(moe.num_experts), moe.num_experts)
    for name, t in tensors:
        m = _EXPERT_NAME.match(name)
        moe = m and model_cls.moe_options(info, int(m.group(1)))
        if moe:
            start, end = tp.split(moe.num_experts)
            if not start <= int(m.group(2)) < end:
                continue
        yield name, t


def stack_experts(model: nn.Module, state: dict[str, torch.Tensor | RunWeight], source: str) -> None:
    """In `state` (the loader's fused state dict), each ExpertLinear's per-expert weights
    `{experts}.{e}.{proj}.weight`, e over its experts, replaced by its one stacked weight `{experts}.{proj}.weight`:
    a float [E, N, K] tensor, or a QuantizedExperts where every expert's weight is kept quantized (some quantized
    and some not: dequantized, logged). ModelLoadError naming the layer and the experts where some are missing."""
    for name, module in model.named_modules():
        if not isinstance(module, ExpertLinear):
            continue
        experts, proj = name.rsplit(".", 1)  # "model.layers.0.mlp.experts", "gate_up_proj"
        ids = range(module.first_expert, module.first_expert + module.num_experts)
        missing = [e for e in ids if f"{experts}.{e}.{proj}.weight" not in state]
        if missing:
            raise ModelLoadError(f"{source}: {experts} lacks the {proj} weights of experts {missing} (the model has "
                                 f"{module.num_experts} experts here, {ids.start} to {ids.stop - 1})")
        parts = [state.pop(f"{experts}.{e}.{proj}.weight") for e in ids]
        state[f"{name}.weight"] = _stack(parts, name, source)


def _quantized(w: object) -> bool:
    return isinstance(w, PackedWeight | Int8ActivationWeight)


def _stack(parts: list[torch.Tensor | RunWeight], name: str, source: str) -> torch.Tensor | QuantizedExperts:
    shapes = {tuple(p.shape) for p in parts}
    if len(shapes) != 1:
        raise ModelLoadError(f"{source}: the experts of {name} have different shapes {sorted(shapes)}")
    if all(_quantized(p) for p in parts):
        return QuantizedExperts(parts)
    if any(_quantized(p) for p in parts):
        logger.info("%s mixes quantized and float experts: dequantized at load", name)
        ref = next(p for p in parts if not _quantized(p))
        parts = [p.dequantize().to(device=ref.device, dtype=ref.dtype) if _quantized(p) else p for p in parts]
    return torch.stack(parts)
