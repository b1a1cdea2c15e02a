"""Gemma 3 text (`Gemma3ForCausalLM`): Gemma 2's decoder (models/gemma2.py: sandwich norms, GeGLU, (1 + w) norms,
the scaled embedding, query_pre_attn_scalar) with these differences, as transformers' Gemma3ForCausalLM:

- an RMSNorm over each head of q and of k before rotary (`q_norm`, `k_norm`, as Qwen3's), also (1 + w);
- no attention soft-cap and no final one, unless config.json (or the GGUF metadata) sets
  `attn_logit_softcapping` / `final_logit_softcapping`;
- sliding-window layers from `layer_types`, else `sliding_window_pattern` (default 6: every 6th layer global);
- two rotaries: the global layers' `rope_theta` with `rope_scaling` (linear for the 4B-27B models), the sliding
  layers' `rope_local_base_freq` (transformers 5: `rope_parameters["sliding_attention"]`) without scaling
  (AttentionOptions.rope: one more table in LlamaModel).

A GGUF file ("gemma3", llama.cpp's converter: norms stored as 1 + w, rope.freq_base the global base, a recent
converter's rope.freq_base_swa the local one) has no pattern: llama.cpp's fixed 6, as here; where it has no local
base, llama.cpp's fixed 10000; no query_pre_attn_scalar: llama.cpp's head_dim ** -0.5, but
(hidden_size / num_heads) ** -0.5 for the 62-layer 27B model, as Gemma 2's. The sliding layers hold only their
window of KV: the hybrid KV cache manager (core/kv_cache_coordinator.py) frees their blocks behind it. The native
decode step has Llama's layer: decode steps run the model's modules
(logged at load with native-kernel weights).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedllm.models.gemma2 import Gemma2ForCausalLM
from pagedllm.models.llama import AttentionOptions, DecoderOptions
from pagedllm.models.model_info import ModelInfo

LLAMA_CPP_LOCAL_ROPE_BASE = 10000.0  # transformers' default too
LLAMA_CPP_SWA_PATTERN = 6  # transformers' default sliding_window_pattern too


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    decoder_options = DecoderOptions(activation="gelu_tanh", embed_scale=True, qk_norm=True)
    native_step_unsupported = "sandwich norms, GeGLU, q/k norms nor per-layer rotary"
    config_defaults: dict[str, Any] = {"sliding_window": 4096}  # transformers' Gemma3TextConfig: no caps
    llama_cpp_27b_layers = 62  # llama.cpp's LLM_TYPE_27B for gemma3

    @classmethod
    def layer_types(cls, info: ModelInfo) -> list[str]:
        pattern = int(info.hf_config.get("sliding_window_pattern") or LLAMA_CPP_SWA_PATTERN)
        return info.hf_config.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(info.num_layers)]

    @classmethod
    def attention_options(cls, info: ModelInfo, layer_idx: int) -> AttentionOptions:
        options = super().attention_options(info, layer_idx)
        if options.sliding_window is None:
            return options  # the model's rotary: rope_theta and rope_scaling
        config = info.hf_config
        local = ((config.get("rope_parameters") or {}).get("sliding_attention") or {}).get("rope_theta")
        base = float(config.get("rope_local_base_freq") or local or LLAMA_CPP_LOCAL_ROPE_BASE)
        return dataclasses.replace(options, rope=(base, None))
