"""Mistral (`MistralForCausalLM`): Llama's decoder with a sliding window on every layer where config.json's
`sliding_window` is set (Mistral 7B v0.1: 4096; null, as in v0.2 and later: full attention). The query at position p
attends the keys at positions > p - window (transformers' sliding_window_overlay), in every attention path and
in the native decode step (the kernels take the window per layer).

llama.cpp writes Mistral GGUF files as "llama" with no window in their metadata: they load as Llama, full attention.
"""

from __future__ import annotations

from pagedllm.models.llama import AttentionOptions, LlamaForCausalLM
from pagedllm.models.model_info import ModelInfo


def config_window(info: ModelInfo) -> int | None:
    """config.json's sliding_window as a positive int, or None (unset, null or 0: full attention)."""
    window = info.hf_config.get("sliding_window")
    return int(window) if window else None


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, info: ModelInfo, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(sliding_window=config_window(info))
