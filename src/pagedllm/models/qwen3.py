"""Qwen3 (`Qwen3ForCausalLM`): Llama with an RMSNorm over each head of q and of k before rotary (`q_norm`,
`k_norm`), no q/k/v biases unless config.json's `attention_bias` says so, and an explicit `head_dim` (which
ModelInfo reads for every family: Qwen3's is not hidden_size / num_heads).

The native decode step (models/llama_native_step.py) has no q/k norms: decode steps run the model's modules.
"""

from __future__ import annotations

from pagedllm.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_options = DecoderOptions(qk_norm=True)
