"""Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`): Llama with biases on q, k and v (none on o_proj nor the MLP).

The small Qwen2.5 models tie the LM head to the embedding (`tie_word_embeddings`), which LlamaForCausalLM
already honours. A `sliding_window` with `use_sliding_window` true caps the context at the window
(models/model_info.py), where full attention equals the windowed one.
"""

from __future__ import annotations

from pagedllm.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    decoder_options = DecoderOptions(qkv_bias=True, o_bias=False)
