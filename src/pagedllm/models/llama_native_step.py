"""A Llama decode step in one native call: every decoder layer and the final norm run in
kernels/llama_decode_cpu.c, the CPU analogue of vLLM replaying a captured CUDA graph for its decode batches.

Why: at batch 1 the kernels of a SmolLM2 step (30 layers x ~10 native calls) take ~12 ms, and the Python and torch
around them (module calls, tensor allocation, ctypes argument conversion, checks) took about as long again. Here
the weights' pointers are gathered once, after load, into C structs, and a step passes its inputs once.

What it computes: exactly `LlamaModel.forward` (models/llama.py stays the reference): the C loop calls the same
kernels in the same order on the same values, so hidden states, logits and the KV cache are bitwise those of the
module path (tests/models/test_llama_native_step.py); the embedding lookup, the rotary table lookup, the attention
plan and the LM head stay in Python, shared with the module path.

When it runs (`forward` returns None otherwise, and the runner runs the model's modules):
- built (`build`): a LlamaForCausalLM (or a family whose layers are Llama's but for biases, sliding windows or
  attention soft-caps: Qwen2 and Mistral, not Qwen3's q/k norms, Gemma 2's layers nor Mixtral's and Qwen3-MoE's
  experts; logged) on the CPU in float32 with the native kernels, every linear of every layer a quantized weight
  run by the native kernels (GGUF codes, `--quantization fp8`, or the int8-activation weights of
  `--activation-quantization int8`), and `PAGEDLLM_NATIVE_STEP` not "0";
- per step: every scheduled row is a decode (verify rows of speculative decoding included: each a decode row
  of its own length) and the attention plan runs the native decode kernel (a KV cache dtype it reads: fp32,
  bf16, fp8), the batch unpadded. Prefill and mixed steps, oneDNN float weights and CUDA keep the module path.

It lives beside models/llama.py because it is a second implementation of one model's forward (it knows Llama's
layer structure); the runner only chooses, per step, which one runs.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from pagedllm import envs
from pagedllm.kernels import cpu_kernels, quant_q8act
from pagedllm.layers.attention import step_plan
from pagedllm.layers.forward_context import get_forward_context
from pagedllm.layers.int8_activation_weight import Int8ActivationWeight
from pagedllm.layers.linear import Linear
from pagedllm.layers.quantized_weight import PackedWeight
from pagedllm.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)
SWITCH_ENV = "PAGEDLLM_NATIVE_STEP"  # "0": never build the native step (the module path runs every step)

LINEAR_PACKED, LINEAR_Q8ACT = 0, 1  # decode_linear.kind in the C file

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Linear(ctypes.Structure):  # decode_linear
    _fields_ = [("kind", _i64), ("bits", _i64), ("group", _i64), ("wtype", _i64), ("w", _ptr), ("d", _ptr),
                ("mn", _ptr), ("bias", _ptr), ("out_features", _i64), ("in_features", _i64)]


class _Layer(ctypes.Structure):  # decode_layer
    _fields_ = [("input_norm", _ptr), ("post_attention_norm", _ptr), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("k_scale", ctypes.c_float), ("v_scale", ctypes.c_float),
                ("k_comp", _ptr), ("window", _i64), ("softcap", ctypes.c_float)]


class _Model(ctypes.Structure):  # decode_model
    _fields_ = [("num_layers", _i64), ("hidden", _i64), ("num_heads", _i64), ("num_kv_heads", _i64),
                ("head_dim", _i64), ("intermediate", _i64), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("final_norm", _ptr)]


@functools.cache
def _kernel():
    """The library's llama_decode_step with its ctypes signature, or None without the native kernels."""
    lib = cpu_kernels._library()
    if lib is None:
        return None
    fn = lib.llama_decode_step
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Layer), _ptr, _i64, ctypes.c_int, _i64, _ptr, _i64, _ptr,
                   _ptr, _ptr, _i64, _ptr, _ptr, _ptr, ctypes.c_int, _ptr, _i64, _ptr, _i64]
    return fn


def _f32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.is_cpu and t.is_contiguous())


def _linear(module: Linear, keep: list[torch.Tensor]) -> _Linear | None:
    """The C description of a Linear run by a native quantized kernel, or None (a float weight: oneDNN)."""
    w, bias = module.quant_weight, module.bias
    if not _f32(bias):
        return None
    bias_ptr = None if bias is None else bias.data_ptr()
    n, k = module.out_features, module.in_features
    if bias is not None:
        keep.append(bias)
    if isinstance(w, PackedWeight):
        keep.append(w.data)
        return _Linear(LINEAR_PACKED, w.bits, w.group, 0, w.data.data_ptr(), None, None, bias_ptr, n, k)
    if isinstance(w, Int8ActivationWeight) and quant_q8act.available():
        keep.extend(t for t in (w.wq, w.d, w.mn) if t is not None)
        return _Linear(LINEAR_Q8ACT, 0, 0, w.kind, w.wq.data_ptr(), w.d.data_ptr(),
                       None if w.mn is None else w.mn.data_ptr(), bias_ptr, n, k)
    return None


class LlamaNativeDecodeStep:
    """The decoder layers and final norm of one LlamaForCausalLM, for all-decode steps, in one native call."""

    def __init__(self, model: LlamaForCausalLM, c_model: _Model, c_layers: ctypes.Array, keep: list[torch.Tensor]):
        self.model = model.model  # LlamaModel: its embedding and rotary table run here too
        self._fn = _kernel()
        self._c_model, self._c_layers = c_model, c_layers
        self._keep = keep  # every tensor whose address the structs hold (the model holds them too)
        info = model.info
        q, kv = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
        self._scratch_floats = q + 2 * kv + q + 3 * info.intermediate_size  # per row: qkv, attn, gate_up, act
        self._attns = [layer.self_attn.attn for layer in model.model.layers]
        self._kv_caches: list[torch.Tensor] | None = None  # the list _key_caches points into
        self._key_caches: ctypes.Array | None = None

    @classmethod
    def build(cls, model: torch.nn.Module) -> LlamaNativeDecodeStep | None:
        """The native step for `model`, or None where it does not apply (the module docstring says when)."""
        if not envs.PAGEDLLM_NATIVE_STEP or not isinstance(model, LlamaForCausalLM):
            return None
        norm = model.model.norm
        if not _f32(norm.weight) or not cpu_kernels.available(norm.weight.dtype, norm.weight.device):
            return None
        if _kernel() is None:
            return None
        info, layers = model.info, model.model.layers
        keep: list[torch.Tensor] = [norm.weight]
        c_layers = (_Layer * len(layers))()
        for c_layer, layer in zip(c_layers, layers, strict=True):
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(not _f32(m.weight) or m.eps != norm.eps for m in norms):
                return None
            linears = [_linear(m, keep) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj)]
            if any(c is None for c in linears):
                return None
            keep.extend(m.weight for m in norms)
            c_layer.input_norm, c_layer.post_attention_norm = (m.weight.data_ptr() for m in norms)
            c_layer.qkv, c_layer.o = linears
        if model.decoder_options.qk_norm:  # the C loop has no per-head q/k norms
            logger.info("%s: the native decode step has no per-head q/k norms; decode steps run the model's "
                        "modules", model.info.architecture)
            return None
        attns = [layer.self_attn.attn for layer in layers]
        missing = model.native_step_unsupported or (
            "per-layer softmax scales" if len({a.scale for a in attns}) > 1 else None) or (
            "per-layer rotary" if model.model.layer_rotary_index is not None else None)  # one table: rotary_emb
        if missing is not None:  # the C loop is Llama's layer (its attention's window and soft-cap are per layer)
            logger.info("%s: the native decode step has no %s; decode steps run the model's modules",
                        model.info.architecture, missing)
            return None
        for c_layer, layer in zip(c_layers, layers, strict=True):  # Llama's gated MLP (a family's are checked above)
            linears = [_linear(m, keep) for m in (layer.mlp.gate_up_proj, layer.mlp.down_proj)]
            if any(c is None for c in linears):
                return None
            c_layer.gate_up, c_layer.down = linears
        for c_layer, attn in zip(c_layers, attns, strict=True):
            c_layer.window, c_layer.softcap = attn.window, attn.softcap
        scale = attns[0].scale if attns else 1.0
        c_model = _Model(len(layers), info.hidden_size, info.num_heads, info.num_kv_heads, info.head_dim,
                         info.intermediate_size, norm.eps, scale, norm.weight.data_ptr())
        return cls(model, c_model, c_layers, keep)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """LlamaModel.forward(input_ids, positions) for a step of decodes: hidden states [T, hidden] after the
        final norm, bitwise the module path's; None when this step is not one (then run the model). Runs inside
        the step's forward context, as the model does."""
        ctx = get_forward_context()
        md = ctx.attn_metadata
        n = input_ids.shape[0]
        if md is None or n != md.num_actual_tokens or len(ctx.kv_caches) != self._c_model.num_layers:
            return None
        plan = step_plan(md, ctx.kv_caches[0], torch.float32, input_ids.device)
        if not (plan.native and plan.all_decode):
            return None
        res = self.model.embed_tokens(input_ids).contiguous()  # [T, hidden]: the residual stream
        cos_sin = self.model.rotary_emb(positions, res.dtype)  # [T, 2, D / 2], contiguous
        h = torch.empty_like(res)
        scratch = torch.empty(n * self._scratch_floats)
        kv = ctx.kv_caches[0]  # [2, num_blocks, block_size, Hkv, D]; every layer's alike
        table, slots = plan.decode_block_table, md.slot_mapping
        cpu_kernels.require(slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape == (n,),
                            "slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape == (n,)")
        self._sync_kv_scales(kv)
        rc = self._fn(self._c_model, self._c_layers, self._key_cache_array(ctx.kv_caches),
                      kv.stride(0) * kv.element_size(), cpu_kernels.KV_FORMATS[kv.dtype], kv.shape[2],
                      table.data_ptr(), table.stride(0), plan.decode_seq_lens.data_ptr(), slots.data_ptr(),
                      cos_sin.data_ptr(), n, res.data_ptr(), h.data_ptr(), scratch.data_ptr(), int(plan.has_verify),
                      *self._groups(plan))
        if rc != 0:
            raise MemoryError("the native decode step's kernels could not allocate their scratch buffers")
        return h

    @staticmethod
    def _groups(plan) -> tuple:
        """llama_decode_step's verify groups (the multi-row kernel's request tables and row starts), or nothing."""
        if plan.rows_start is None:
            return (None, 0, None, 0)
        return (plan.rows_block_table.data_ptr(), plan.rows_block_table.stride(0), plan.rows_start.data_ptr(),
                len(plan.rows_block_table))

    def _sync_kv_scales(self, kv: torch.Tensor) -> None:
        """Each layer's k_scale, v_scale and K rounding weights as its PagedAttention holds them now (they are set
        after load, by --calculate-kv-scales; a few attribute copies per layer, every step)."""
        hkv_d = (kv.shape[3], kv.shape[4])
        for c_layer, attn in zip(self._c_layers, self._attns, strict=True):
            c_layer.k_scale, c_layer.v_scale = attn.k_scale, attn.v_scale
            c_layer.k_comp = cpu_kernels._comp_ptr(attn.k_comp, hkv_d)

    def _key_cache_array(self, kv_caches: list[torch.Tensor]) -> ctypes.Array:
        """Each layer's K cache address (its V cache follows at kv.stride(0)), built once per list of caches."""
        if kv_caches is not self._kv_caches:
            first = kv_caches[0]
            for kv in kv_caches:
                cpu_kernels.require(kv.is_contiguous() and kv.dtype == first.dtype and kv.shape == first.shape
                                    and kv.is_cpu, "every layer's KV cache contiguous, on the CPU, alike")
            self._key_caches = (ctypes.c_void_p * len(kv_caches))(*(kv.data_ptr() for kv in kv_caches))
            self._kv_caches = kv_caches
        return self._key_caches
