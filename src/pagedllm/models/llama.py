"""Llama for causal LM (SmolLM2, Llama 2/3, Mistral-style): GQA, rope scaling, tied embeddings.

Parameter names are Hugging Face's, with q/k/v fused into `qkv_proj` and gate/up into `gate_up_proj`
(the loader concatenates them, in that order). Built on the meta device, then loaded with assign=True.

Families whose decoder is Llama's but for a few switches (qkv biases, per-head q/k norms, the MLP's activation,
a scaled embedding) are subclasses that set `decoder_options` (a `DecoderOptions`): models/qwen2.py,
models/qwen3.py. A family whose layers attend differently (a sliding window, logit soft-capping, another softmax
scale, their own rope base) overrides `attention_options` (per layer: models/mistral.py, models/gemma2.py,
models/gemma3.py); one whose layer is shaped differently sets `decoder_layer` (Gemma 2's sandwich norms). A family
whose checkpoint stores q/k/v or gate/up already fused sets `fused_checkpoint_modules` (models/phi3.py); partial rotary
(ModelInfo.rotary_dim) needs nothing from a family (models/checkpoint_tensors.py, layers/rotary.py). A family whose
MLP is a sparse mixture of experts on some layers overrides `moe_options` (layers/fused_moe.py; models/mixtral.py,
models/qwen3_moe.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.distributed.pipeline_parallel import PipelineParallelGroup
from pagedllm.layers.activation import GeluTanhAndMul, SiluAndMul
from pagedllm.layers.attention import PagedAttention
from pagedllm.layers.embedding import VocabEmbedding
from pagedllm.layers.fused_moe import FusedMoE, MoEOptions
from pagedllm.layers.linear import Linear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.model_info import ModelInfo


@dataclass(frozen=True)
class DecoderOptions:
    """How a Llama-shaped family's decoder differs from Llama's; the defaults are Llama."""

    qkv_bias: bool | None = None  # biases on q/k/v (None: config.json's attention_bias, as Llama)
    o_bias: bool | None = None  # a bias on o_proj (None: config.json's attention_bias)
    qk_norm: bool = False  # an RMSNorm over each head of q and of k before rotary (`q_norm`, `k_norm`: Qwen3)
    activation: str = "silu"  # the MLP's gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma 2)
    embed_scale: bool = False  # the embeddings times sqrt(hidden_size), in the activation dtype (Gemma)


@dataclass(frozen=True)
class AttentionOptions:
    """One layer's attention (layers/attention.py's PagedAttention options); the defaults are Llama's."""

    sliding_window: int | None = None  # the query at position p attends the keys at positions > p - window
    logit_softcap: float | None = None  # scores = cap * tanh(scores / cap) before the softmax (Gemma 2)
    scale: float | None = None  # the softmax scale (None: head_dim ** -0.5)
    # this layer's own rotary: (rope base, transformers' rope_scaling dict or None); None: the model's (ModelInfo's
    # rope_theta, rope_scaling and freq factors). Gemma 3's sliding layers: (rope_local_base_freq, None)
    rope: tuple[float, dict[str, Any] | None] | None = None


class LlamaAttention(nn.Module):
    """With tensor parallelism: this rank's query heads and KV heads (qkv_proj column-parallel), o_proj
    row-parallel over them, then one all-reduce."""

    def __init__(self, info: ModelInfo, layer_idx: int, tp: TensorParallelGroup,
                 options: DecoderOptions = DecoderOptions(), attention: AttentionOptions = AttentionOptions()):
        super().__init__()
        self.tp = tp
        first_kv, end_kv = tp.kv_heads(info.num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = info.num_heads // tp.size, end_kv - first_kv, info.head_dim
        self.q_size = self.num_heads * info.head_dim
        self.kv_size = self.num_kv_heads * info.head_dim
        qkv_bias = info.attention_bias if options.qkv_bias is None else options.qkv_bias
        o_bias = info.attention_bias if options.o_bias is None else options.o_bias
        self.qkv_proj = Linear(info.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, info.hidden_size, bias=o_bias)
        if options.qk_norm:  # one weight per head dimension, shared by every head (replicated across TP ranks)
            self.q_norm = RMSNorm(info.head_dim, info.rms_norm_eps)
            self.k_norm = RMSNorm(info.head_dim, info.rms_norm_eps)
        self.qk_norm = options.qk_norm
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, info.head_dim, layer_idx,
                                   attention.sliding_window, attention.logit_softcap, attention.scale)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]; cos_sin: [T, 2, D / 2] -> [T, hidden]
        # rotary inside the attention: fused with the decode attention
        qkv = self.qkv_proj(x)  # [T, (H + 2 * Hkv) * D]
        if self.qk_norm:
            qkv = self._norm_qk(qkv)
        return self.tp.all_reduce(self.o_proj(self.attn(qkv, cos_sin)))

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv with each head of q and of k RMS-normalized over its head_dim (Qwen3), v unchanged."""
        t, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=1)
        q = self.q_norm(q.reshape(-1, d))  # [T * H, D]; reshape copies the strided slice: contiguous
        k = self.k_norm(k.reshape(-1, d))  # [T * Hkv, D]
        return torch.cat([q.view(t, self.q_size), k.view(t, self.kv_size), v], dim=1)


class LlamaMLP(nn.Module):
    """With tensor parallelism: this rank's columns of the intermediate size (gate_up_proj column-parallel,
    down_proj row-parallel), then one all-reduce."""

    def __init__(self, info: ModelInfo, tp: TensorParallelGroup, options: DecoderOptions = DecoderOptions()):
        super().__init__()
        self.tp = tp
        intermediate_size = info.intermediate_size // tp.size
        self.gate_up_proj = Linear(info.hidden_size, 2 * intermediate_size, bias=info.mlp_bias)
        self.down_proj = Linear(intermediate_size, info.hidden_size, bias=info.mlp_bias)
        self.act_fn = SiluAndMul() if options.activation == "silu" else GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.act_fn(self.gate_up_proj(x))))  # [T, hidden]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, info: ModelInfo, layer_idx: int, tp: TensorParallelGroup,
                 options: DecoderOptions = DecoderOptions(), attention: AttentionOptions = AttentionOptions(),
                 moe: MoEOptions | None = None):
        super().__init__()
        self.self_attn = LlamaAttention(info, layer_idx, tp, options, attention)
        # a sparse mixture of experts where the family's moe_options says so, else the dense gated MLP
        self.mlp = LlamaMLP(info, tp, options) if moe is None else FusedMoE(info.hidden_size, moe, tp)
        self.input_layernorm = RMSNorm(info.hidden_size, info.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(info.hidden_size, info.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried unsummed, as in vLLM: each norm adds the previous sublayer's output to
        it and normalizes in one fused op.

        hidden_states: [T, hidden], the previous layer's MLP output (the embeddings for the first layer);
        residual: [T, hidden], the stream before that output (None for the first layer).
        Returns (this layer's MLP output, the stream before it), each [T, hidden]: their sum is the layer's
        output. The native norms write into both inputs (callers pass tensors they no longer need).
        """
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, cos_sin)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """With pipeline parallelism: this stage's layers [start, end) (the others are parameterless placeholders, so
    the parameter names keep the checkpoint's layer numbers); the embedding on the first stage (and the last when
    the LM head is tied to it), the final norm on the last. Layer i caches in this stage's KV cache i - start."""

    def __init__(self, info: ModelInfo, tp: TensorParallelGroup, pp: PipelineParallelGroup,
                 family: type[LlamaForCausalLM] | None = None):
        super().__init__()
        family = family or LlamaForCausalLM
        options = family.decoder_options
        self.embed_scale = info.hidden_size**0.5 if options.embed_scale else None
        self.pp = pp
        self.start_layer, self.end_layer = pp.layers(info.num_layers)
        if pp.is_first or (pp.is_last and info.tie_word_embeddings):
            # An explicit _weight skips nn.Embedding's normal_() init: on the meta device that op imports
            # torch._dynamo (~3-6 s of cold start) for a tensor the loader replaces anyway.
            vocab_start, vocab_end = tp.padded_split(info.vocab_size)
            self.embed_tokens = VocabEmbedding(vocab_end - vocab_start, info.hidden_size,
                                               _weight=torch.empty(vocab_end - vocab_start, info.hidden_size))
            if tp.size > 1:
                self.embed_tokens.shard(tp, vocab_start)
        attention = [family.attention_options(info, i) for i in range(info.num_layers)]
        self.layers = nn.ModuleList(
            family.decoder_layer(info, i - self.start_layer, tp, options, attention[i], family.moe_options(info, i))
            if self.start_layer <= i < self.end_layer else nn.Identity() for i in range(info.num_layers))
        if pp.is_last:
            self.norm = RMSNorm(info.hidden_size, info.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(info.head_dim, info.max_position_embeddings, info.rope_theta,
                                          info.rope_scaling, info.rope_freq_factors, info.rotary_dim)
        # Layers with their own rotary (AttentionOptions.rope): one more table per distinct setting, and each of
        # this stage's layers the index of its table in [rotary_emb, *layer_rotary]; None where every layer uses
        # rotary_emb (every family but Gemma 3: one table looked up per step, as before)
        own = {repr(attention[i].rope): attention[i].rope for i in range(self.start_layer, self.end_layer)
               if attention[i].rope is not None}
        self.layer_rotary = nn.ModuleList(
            RotaryEmbedding(info.head_dim, info.max_position_embeddings, theta, scaling, rotary_dim=info.rotary_dim)
            for theta, scaling in own.values())
        self.layer_rotary_index = [
            0 if attention[i].rope is None else 1 + list(own).index(repr(attention[i].rope))
            for i in range(self.start_layer, self.end_layer)] if own else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions: [T] int64; `intermediate`: the previous stage's (hidden_states, residual), each
        [T, hidden] (None on the first stage). Returns hidden_states [T, hidden] on the last stage, else this
        stage's (hidden_states, residual) for the next."""
        if intermediate is None:
            hidden_states = self.embed_tokens(input_ids)  # [T, hidden], a new tensor (the norms may write into it)
            if self.embed_scale is not None:  # as transformers' Gemma: the factor rounded to the activation dtype
                hidden_states = hidden_states * torch.tensor(self.embed_scale, dtype=hidden_states.dtype)
            residual = None
        else:
            hidden_states, residual = intermediate
        cos_sin = self.rotary_emb(positions, hidden_states.dtype)  # [T, 2, D / 2]
        layers = self.layers[self.start_layer:self.end_layer]
        if self.layer_rotary_index is None:
            for layer in layers:
                hidden_states, residual = layer(hidden_states, residual, cos_sin)
        else:  # each layer its table's rows, each table looked up once
            tables = [cos_sin, *(rotary(positions, hidden_states.dtype) for rotary in self.layer_rotary)]
            for layer, index in zip(layers, self.layer_rotary_index, strict=True):
                hidden_states, residual = layer(hidden_states, residual, tables[index])
        if not self.pp.is_last:
            return hidden_states, residual
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    decoder_options = DecoderOptions()  # a family's switches (subclasses set them)
    decoder_layer: type[nn.Module] = LlamaDecoderLayer  # (info, layer_idx, tp, options, attention, moe) -> a layer
    native_step_unsupported: str | None = None  # why the native decode step cannot run this family (None: it can)
    # transformers' config defaults for the keys a family reads from ModelInfo.hf_config (config_value)
    config_defaults: dict[str, Any] = {}

    @classmethod
    def config_value(cls, info: ModelInfo, key: str) -> Any:
        """config.json's `key` (a GGUF file: its metadata's, models/gguf_loader.py), else the family's default."""
        return info.hf_config.get(key, cls.config_defaults.get(key))

    @classmethod
    def attention_options(cls, info: ModelInfo, layer_idx: int) -> AttentionOptions:
        """Layer `layer_idx`'s attention options (a family with windows, caps or another scale overrides it)."""
        return AttentionOptions()

    @classmethod
    def moe_options(cls, info: ModelInfo, layer_idx: int) -> MoEOptions | None:
        """Layer `layer_idx`'s mixture of experts, None for a dense MLP (every layer here; models/mixtral.py,
        models/qwen3_moe.py override it)."""
        return None

    @classmethod
    def checkpoint_tensors(cls, tensors: Iterator[tuple[str, Any]], kind: str) -> Iterator[tuple[str, Any]]:
        """The checkpoint's (name, tensor) pairs as this model's parameters hold them (`kind`: "hf" or "gguf");
        a family whose checkpoint stores a weight differently overrides it (Gemma 2's norms)."""
        return tensors

    # checkpoint name fragment -> (fused parameter fragment, shard index in the fused order)
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    # A checkpoint's already-fused tensor name fragment -> its parts' fragments, in order (Phi-3 stores qkv_proj and
    # gate_up_proj): split at load (models/checkpoint_tensors.py), then sliced and fused as separate ones would be
    fused_checkpoint_modules: dict[str, tuple[str, ...]] = {}

    # checkpoint name fragment -> how tensor parallelism slices it (models/tensor_parallel_weights.py)
    tensor_parallel_plan = {
        "q_proj": "q_heads", "k_proj": "kv_heads", "v_proj": "kv_heads", "o_proj": "in",
        "gate_proj": "out", "up_proj": "out", "down_proj": "in", "embed_tokens": "vocab", "lm_head": "vocab",
    }

    def __init__(self, info: ModelInfo, tp: TensorParallelGroup | None = None,
                 pp: PipelineParallelGroup | None = None):
        super().__init__()
        self.info = info
        self.tp = tp = tp or TensorParallelGroup.single()
        self.pp = pp = pp or PipelineParallelGroup.single()
        self.model = LlamaModel(info, tp, pp, type(self))
        start, end = self.model.start_layer, self.model.end_layer
        self.num_layers = end - start
        """Layers this stage runs and caches (all of them at pipeline-parallel size 1)."""
        self.num_kv_heads = self.model.layers[start].self_attn.num_kv_heads if end > start else info.num_kv_heads
        """KV heads this rank attends with and caches (all of them at tensor-parallel size 1)."""
        if pp.is_last:
            vocab_start, vocab_end = tp.padded_split(info.vocab_size)
            self.lm_head = Linear(info.hidden_size, vocab_end - vocab_start, bias=False)

    def tie_weights(self) -> None:
        if not self.info.tie_word_embeddings or not self.pp.is_last:
            return
        embed = self.model.embed_tokens
        if embed.quant_weight is not None:
            self.lm_head.set_quantized_weight(embed.quant_weight)  # the same packed table, not a copy
        else:
            self.lm_head.weight = embed.weight

    def materialize(self, device: torch.device) -> None:
        """Compute the buffers that are not weights (rotary table) on `device`, after loading."""
        self.model.rotary_emb.materialize(device)
        for rotary in self.model.layer_rotary:
            rotary.materialize(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.model(input_ids, positions, intermediate)  # [T, hidden] (a stage before the last: a pair)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # [N, hidden] -> [N, vocab] float32; with tensor parallelism each rank's vocabulary slice, gathered
        logits = self.lm_head(hidden_states).float()
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits)[:, : self.info.vocab_size]
