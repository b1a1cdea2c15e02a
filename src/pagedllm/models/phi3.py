"""Phi-3 (`Phi3ForCausalLM`: Phi-3 mini / small-context / 128k, Phi-3.5-mini, Phi-4-mini): Llama's decoder, with
checkpoints that store q/k/v fused in `qkv_proj` and gate/up fused in `gate_up_proj` (split at load so that tensor
parallelism slices them by heads and halves, then fused back: models/checkpoint_tensors.py), rotary on the first
`partial_rotary_factor` of each head where set (Phi-4-mini: 0.75; layers/rotary.py), and longrope scaling with
short and long factors (Phi-3-*-128k, layers/rotary.py). Its `sliding_window` (Phi-3-mini-4k: 2047) applies to
every layer, as Mistral's does and as transformers' Phi3 applies it (in a GGUF file: `phi3.attention.sliding_window`).
"""

from __future__ import annotations

from pagedllm.models.mistral import MistralForCausalLM


class Phi3ForCausalLM(MistralForCausalLM):  # Mistral's window

    fused_checkpoint_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
