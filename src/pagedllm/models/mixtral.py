"""Mixtral (`MixtralForCausalLM`: Mixtral 8x7B, 8x22B): Mistral's decoder (models/mistral.py: a window where
config.json's `sliding_window` is set, null in the released models) with a sparse mixture of experts as every
layer's MLP (layers/fused_moe.py), as transformers' Mixtral:

- routing: each token's top `num_experts_per_tok` of `num_local_experts` experts, weighted by the softmax over their
  router logits (computed as transformers does: softmax over all, top-k, renormalised; the same numbers);
- experts of `intermediate_size`, stored per expert as `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up) and `w2`
  (down) beside the router `block_sparse_moe.gate`: renamed at load to Qwen3-MoE's names (`mlp.gate`,
  `mlp.experts.{e}.gate_proj/up_proj/down_proj`) and stacked (models/expert_weights.py).

llama.cpp writes Mixtral GGUF files as "llama" with `llama.expert_count` (and no window): they load as this family
(models/gguf_loader.py). The native decode step has no experts: decode steps run the modules (logged at load).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pagedllm.layers.fused_moe import MoEOptions
from pagedllm.models.mistral import MistralForCausalLM
from pagedllm.models.model_info import ModelInfo

# checkpoint name fragment -> the name the loader reads (models/expert_weights.py)
CHECKPOINT_NAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


def _renamed(name: str) -> str:
    for old, new in CHECKPOINT_NAMES.items():
        name = name.replace(old, new)
    return name


class MixtralForCausalLM(MistralForCausalLM):
    native_step_unsupported = "mixture-of-experts layers"
    # transformers' MixtralConfig defaults, for a config.json (or GGUF metadata) that lacks a key
    config_defaults: dict[str, Any] = {"num_local_experts": 8, "num_experts_per_tok": 2}

    @classmethod
    def moe_options(cls, info: ModelInfo, layer_idx: int) -> MoEOptions | None:
        return MoEOptions(int(cls.config_value(info, "num_local_experts")),
                          int(cls.config_value(info, "num_experts_per_tok")), info.intermediate_size, renormalize=True)

    @classmethod
    def checkpoint_tensors(cls, tensors: Iterator[tuple[str, Any]], kind: str) -> Iterator[tuple[str, Any]]:
        if kind == "gguf":  # named by models/gguf_loader.py already
            return tensors
        return ((_renamed(name), t) for name, t in tensors)
