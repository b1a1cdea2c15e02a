"""Qwen3-MoE (`Qwen3MoeForCausalLM`: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k norms,
models/qwen3.py) with a sparse mixture of experts as the MLP (layers/fused_moe.py), as transformers' Qwen3Moe:

- routing: softmax over all `num_experts` router logits, the top `num_experts_per_tok`, renormalised to sum 1 only
  where `norm_topk_prob` (transformers' default false; the released models set it);
- experts of `moe_intermediate_size`, stored per expert (`mlp.experts.{e}.gate_proj/up_proj/down_proj`) and stacked
  at load (models/expert_weights.py);
- dense layers: a layer in `mlp_only_layers`, or one whose (index + 1) is not a multiple of `decoder_sparse_step`,
  has Llama's gated MLP of `intermediate_size` (`mlp.gate_proj/up_proj/down_proj`); every layer is sparse in the
  released models;
- `use_sliding_window` puts `sliding_window` on every layer (transformers' Qwen3MoeAttention).

A GGUF file ("qwen3moe": ffn_gate_inp and the stacked ffn_{gate,up,down}_exps) has no norm_topk_prob: llama.cpp's
qwen3moe graph always renormalises, and so do its files here (`{arch}.expert_weights_norm` where written).
The native decode step has neither the q/k norms nor the experts: decode steps run the modules (logged at load).
"""

from __future__ import annotations

from typing import Any

from pagedllm.layers.fused_moe import MoEOptions
from pagedllm.models.llama import AttentionOptions
from pagedllm.models.mistral import config_window
from pagedllm.models.model_info import ModelInfo
from pagedllm.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    native_step_unsupported = "mixture-of-experts layers"
    # transformers' Qwen3MoeConfig defaults, for a config.json (or GGUF metadata) that lacks a key
    config_defaults: dict[str, Any] = {"num_local_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                                       "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": None}

    @classmethod
    def moe_options(cls, info: ModelInfo, layer_idx: int) -> MoEOptions | None:
        # the released config.json files say num_experts; transformers 5 saves it as num_local_experts
        num_experts = int(info.hf_config.get("num_experts") or cls.config_value(info, "num_local_experts"))
        step = int(cls.config_value(info, "decoder_sparse_step"))
        if num_experts == 0 or layer_idx in (cls.config_value(info, "mlp_only_layers") or ()) or (layer_idx + 1) % step:
            return None  # a dense layer
        return MoEOptions(num_experts, int(cls.config_value(info, "num_experts_per_tok")),
                          int(cls.config_value(info, "moe_intermediate_size")),
                          bool(cls.config_value(info, "norm_topk_prob")))

    @classmethod
    def attention_options(cls, info: ModelInfo, layer_idx: int) -> AttentionOptions:
        sliding = info.hf_config.get("use_sliding_window", False)
        return AttentionOptions(sliding_window=config_window(info) if sliding else None)
