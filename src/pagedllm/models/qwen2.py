"""Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`): Llama with biases on q, k and v (none on o_proj nor the MLP).

The small Qwen2.5 models tie the LM head to the embedding (`tie_word_embeddings`), which LlamaForCausalLM
already honours. Sliding-window attention as transformers' Qwen2Config defines it: only with
`use_sliding_window` true, on the layers config.json's `layer_types` names "sliding_attention", or without that
list on layers >= `max_window_layers` (the released Qwen2 / 2.5 checkpoints have use_sliding_window false).
"""

from __future__ import annotations

from pagedllm.models.llama import AttentionOptions, DecoderOptions, LlamaForCausalLM
from pagedllm.models.mistral import config_window
from pagedllm.models.model_info import ModelInfo


class Qwen2ForCausalLM(LlamaForCausalLM):
    decoder_options = DecoderOptions(qkv_bias=True, o_bias=False)

    @classmethod
    def attention_options(cls, info: ModelInfo, layer_idx: int) -> AttentionOptions:
        config = info.hf_config
        window = config_window(info) if config.get("use_sliding_window", False) else None
        layer_types = config.get("layer_types")
        if layer_types:
            sliding = layer_types[layer_idx] == "sliding_attention"
        else:
            sliding = layer_idx >= int(config.get("max_window_layers", 28))
        return AttentionOptions(sliding_window=window if sliding else None)
