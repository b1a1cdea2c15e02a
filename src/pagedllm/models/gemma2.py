"""Gemma 2 (`Gemma2ForCausalLM`): Llama's attention and gated MLP with these differences, as transformers' Gemma2:

- GeGLU: gelu(gate, tanh approximation) * up (`hidden_activation` gelu_pytorch_tanh);
- sandwich norms: input_layernorm before attention and post_attention_layernorm after it, pre_feedforward_layernorm
  before the MLP and post_feedforward_layernorm after it, each sublayer's normalized output added to the residual;
- RMSNorm scaled by (1 + w): the checkpoint's norm weights get 1 added at load (in float32), as llama.cpp's
  converter stores them in a GGUF file (which are therefore loaded as they are);
- the embeddings times sqrt(hidden_size), the factor rounded to the activation dtype;
- the softmax scale query_pre_attn_scalar ** -0.5, attention logits soft-capped at `attn_logit_softcapping`, the
  final logits at `final_logit_softcapping`;
- sliding-window and global layers alternating: `layer_types` where config.json has it, else transformers'
  default (even layers slide: 0, 2, ...; llama.cpp's swa pattern 2 too).

A GGUF file has no query_pre_attn_scalar: llama.cpp scales by head_dim ** -0.5, except for the 46-layer 27B model,
hidden_size / num_heads (which is that model's query_pre_attn_scalar, 144); the same here. The native decode step
has Llama's layer (no sandwich norms, no GeGLU): decode steps run the model's modules (logged at load with
native-kernel weights).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.distributed.pipeline_parallel import PipelineParallelGroup
from pagedllm.layers.fused_moe import MoEOptions
from pagedllm.layers.norm import RMSNorm
from pagedllm.models.llama import AttentionOptions, DecoderOptions, LlamaDecoderLayer, LlamaForCausalLM
from pagedllm.models.model_info import ModelInfo


class Gemma2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, info: ModelInfo, layer_idx: int, tp: TensorParallelGroup, options: DecoderOptions,
                 attention: AttentionOptions, moe: MoEOptions | None = None):
        super().__init__(info, layer_idx, tp, options, attention, moe)
        self.pre_feedforward_layernorm = RMSNorm(info.hidden_size, info.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(info.hidden_size, info.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward (the residual stream carried unsummed): each sublayer's output is
        normalized by its post norm before it joins the stream."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(hidden_states, cos_sin))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    decoder_options = DecoderOptions(activation="gelu_tanh", embed_scale=True)
    decoder_layer = Gemma2DecoderLayer
    native_step_unsupported = "sandwich norms, GeGLU nor scaled embedding"
    # transformers' Gemma2Config defaults, for a config.json (or GGUF metadata) that lacks a key
    config_defaults: dict[str, Any] = {"sliding_window": 4096, "attn_logit_softcapping": 50.0,
                                       "final_logit_softcapping": 30.0}
    llama_cpp_27b_layers = 46  # llama.cpp's LLM_TYPE_27B for gemma2, scaled by hidden_size / num_heads

    @classmethod
    def layer_types(cls, info: ModelInfo) -> list[str]:
        """Each layer's "sliding_attention" or "full_attention": config.json's, else even layers slide."""
        return info.hf_config.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(info.num_layers)]

    @classmethod
    def attention_options(cls, info: ModelInfo, layer_idx: int) -> AttentionOptions:
        sliding = cls.layer_types(info)[layer_idx] == "sliding_attention"
        window = cls.config_value(info, "sliding_window") if sliding else None
        scalar = info.hf_config.get("query_pre_attn_scalar")
        if scalar is None:  # a GGUF file: llama.cpp's choice (module docstring)
            scalar = (info.hidden_size // info.num_heads if info.num_layers == cls.llama_cpp_27b_layers
                      else info.head_dim)
        return AttentionOptions(sliding_window=int(window) if window else None, scale=float(scalar) ** -0.5,
                                logit_softcap=cls.config_value(info, "attn_logit_softcapping"))

    @classmethod
    def checkpoint_tensors(cls, tensors: Iterator[tuple[str, Any]], kind: str) -> Iterator[tuple[str, Any]]:
        if kind == "gguf":  # llama.cpp's converter already stored 1 + w
            return tensors
        return ((name, t.float() + 1.0 if name.endswith("norm.weight") else t) for name, t in tensors)

    def __init__(self, info: ModelInfo, tp: TensorParallelGroup | None = None,
                 pp: PipelineParallelGroup | None = None):
        super().__init__(info, tp, pp)
        cap = self.config_value(info, "final_logit_softcapping")
        self.final_logit_softcap = float(cap) if cap else None

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)  # [N, vocab] float32
        if self.final_logit_softcap is not None:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits
