"""GGUF files: metadata -> ModelInfo, tensors -> dequantized float32 arrays (or, for quantized execution, the
linear and embedding weights as QuantizedWeight: codes and scales, never dequantized) under Hugging Face names.

llama.cpp stores a Llama's Q and K projections with their rows permuted for its interleaved rotary layout;
`unpermute_qk` undoes that (as transformers' GGUF loader does) so the rotate-half layout applies; a quantized
weight's rows (codes, scales and offsets alike) are permuted the same way. Families llama.cpp runs with its
rotate-half ("NEOX") rotary, such as Qwen2 and Qwen3, are stored unpermuted (`GGUFArchitecture.rotary_permuted`).
Phi-3's file ("phi3") has q/k/v fused in `attn_qkv` and gate/up fused in `ffn_up` (gate first), which load as its
checkpoint's `qkv_proj` and `gate_up_proj`, and longrope as `rope_factors_short` / `rope_factors_long` tensors.
A mixture of experts ("qwen3moe"; Mixtral, which llama.cpp writes as "llama" with `llama.expert_count`) has its router
in `ffn_gate_inp` and each layer's experts stacked in `ffn_{gate,up,down}_exps` [E, N, K]; those are yielded one
expert at a time under the per-expert names models/expert_weights.py reads (a quantized one cut by whole rows).
Every tensor's byte size is checked against its type and shape, and quantized blocks' fp16 scales must be finite,
so a truncated or corrupt file fails the load, not a later step.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from pagedllm.models.gguf_dequant import dequantize
from pagedllm.models.gguf_reader import GGUFFile
from pagedllm.models.gguf_unpack import UNPACKED_TYPES, check_scales, unpack
from pagedllm.models.model_info import ModelInfo, ModelLoadError
from pagedllm.models.quantized_codes import QuantizedWeight

SUPPORTED_TYPES = tuple(GGMLQuantizationType[name] for name in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"))


@dataclass(frozen=True)
class GGUFArchitecture:
    architecture: str  # the Hugging Face architectures name (models/registry.py)
    rotary_permuted: bool = True  # Q/K rows permuted by llama.cpp's converter (its interleaved rotary)
    layer_names: dict[str, str] = field(default_factory=dict)  # llama.cpp layer tensor -> HF name, over _LAYER_NAMES
    # metadata key after "{arch}." -> the config.json key it is (ModelInfo.hf_config: what the family reads)
    config_keys: dict[str, str] = field(default_factory=dict)
    # config.json values llama.cpp assumes for the architecture where the metadata has no key for them
    config_defaults: dict[str, object] = field(default_factory=dict)
    moe_architecture: str | None = None  # the architecture instead where the file has experts ({arch}.expert_count)


_MOE_KEYS = {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
             "expert_feed_forward_length": "moe_intermediate_size", "expert_weights_norm": "norm_topk_prob"}
_GEMMA_LAYER_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}  # sandwich norms

# general.architecture -> the model it is. llama.cpp writes Llama, Mistral and SmolLM2 as "llama".
GGUF_ARCHITECTURES = {
    "llama": GGUFArchitecture("LlamaForCausalLM", moe_architecture="MixtralForCausalLM",
                              config_keys={"expert_count": "num_local_experts",
                                           "expert_used_count": "num_experts_per_tok"}),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", rotary_permuted=False),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", rotary_permuted=False),
    "qwen3moe": GGUFArchitecture(  # llama.cpp's qwen3moe graph renormalises the top-k weights, and has no dense layer
        "Qwen3MoeForCausalLM", rotary_permuted=False, config_keys=_MOE_KEYS, config_defaults={"norm_topk_prob": True}),
    "gemma2": GGUFArchitecture(
        "Gemma2ForCausalLM", rotary_permuted=False, layer_names=_GEMMA_LAYER_NAMES,
        config_keys={"attention.sliding_window": "sliding_window", "attn_logit_softcapping": "attn_logit_softcapping",
                     "final_logit_softcapping": "final_logit_softcapping"}),
    "gemma3": GGUFArchitecture(  # no swa pattern: llama.cpp's fixed one (models/gemma3.py)
        "Gemma3ForCausalLM", rotary_permuted=False, layer_names=_GEMMA_LAYER_NAMES,
        config_keys={"attention.sliding_window": "sliding_window", "rope.freq_base_swa": "rope_local_base_freq",
                     "final_logit_softcapping": "final_logit_softcapping"}),
    "phi3": GGUFArchitecture("Phi3ForCausalLM", rotary_permuted=False,
                             layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                             config_keys={"attention.sliding_window": "sliding_window"}),
}
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")  # in ModelInfo

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def open_gguf(path: Path) -> GGUFFile:
    """Parse the header, metadata and tensor index; any malformation becomes ModelLoadError."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read GGUF file ({e.strerror})") from None
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        return GGUFFile(path)
    except Exception as e:  # GGUFFormatError, UnicodeDecodeError, struct.error... on corrupt input
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None


def _field(reader: GGUFFile, key: str, path: Path, default: Any = ...) -> Any:
    if key not in reader.metadata:
        if default is ...:
            raise ModelLoadError(f"{path}: GGUF metadata lacks required key {key!r}")
        return default
    return reader.metadata[key]


def _int_field(reader: GGUFFile, key: str, path: Path, default: Any = ...) -> int:
    value = _field(reader, key, path, default)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ModelLoadError(f"{path}: GGUF metadata key {key!r} is malformed (expected a number, got "
                             f"{type(value).__name__})")
    return int(value)


def gguf_model_info(reader: GGUFFile, path: Path) -> ModelInfo:
    arch = _field(reader, "general.architecture", path)
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported "
                             f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    num_heads = _int_field(reader, f"{arch}.attention.head_count", path)
    hidden = _int_field(reader, f"{arch}.embedding_length", path)
    head_dim = _int_field(reader, f"{arch}.attention.key_length", path, hidden // max(num_heads, 1))
    max_positions = _int_field(reader, f"{arch}.context_length", path)
    scaling = None
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", path, "none")
    if scaling_type == "linear":
        scaling = {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor", path))}
    elif scaling_type != "none":
        raise ModelLoadError(f"{path}: rope scaling {scaling_type!r} is not supported")
    factors = {t.name: t for t in reader.tensors if t.name in _ROPE_TENSORS[1:]}
    if factors:  # llama.cpp's longrope (Phi-3 128k): both factor tensors, the attention factor, the original context
        if len(factors) != 2:
            raise ModelLoadError(f"{path}: longrope needs both rope_factors_short and rope_factors_long")
        scaling = {"rope_type": "longrope", "max_position_embeddings": max_positions,
                   "original_max_position_embeddings": _int_field(
                       reader, f"{arch}.rope.scaling.original_context_length", path),
                   "attention_factor": float(_field(reader, f"{arch}.rope.scaling.attn_factor", path, 1.0))}
        for kind in ("short", "long"):
            scaling[f"{kind}_factor"] = [float(x) for x in
                                         dequantize_tensor(factors[f"rope_factors_{kind}.weight"], path).reshape(-1)]
    rotary_dim = _int_field(reader, f"{arch}.rope.dimension_count", path, head_dim)
    tokens = reader.metadata.get("tokenizer.ggml.tokens")
    eos = [_field(reader, key, path, None) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    freq_factors = None
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        freq_factors = tuple(float(x) for x in dequantize_tensor(rope_freqs, path).reshape(-1))
    spec = GGUF_ARCHITECTURES[arch]
    experts = _int_field(reader, f"{arch}.expert_count", path, 0)
    info = ModelInfo(
        architecture=spec.moe_architecture if experts and spec.moe_architecture else spec.architecture,
        num_layers=_int_field(reader, f"{arch}.block_count", path),
        hidden_size=hidden,
        intermediate_size=_int_field(reader, f"{arch}.feed_forward_length", path),
        num_heads=num_heads,
        num_kv_heads=_int_field(reader, f"{arch}.attention.head_count_kv", path, num_heads),
        head_dim=head_dim,
        vocab_size=_int_field(reader, f"{arch}.vocab_size", path, len(tokens) if tokens else 0),
        max_position_embeddings=max_positions,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", path, 1e-5)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", path, 10000.0)),
        rope_scaling=scaling,
        rope_freq_factors=freq_factors,
        rotary_dim=rotary_dim if rotary_dim < head_dim else None,
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", path, None),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        hf_config={**spec.config_defaults, **{hf_key: reader.metadata[f"{arch}.{key}"]
                                              for key, hf_key in spec.config_keys.items()
                                              if f"{arch}.{key}" in reader.metadata}},
    )
    info.validate(str(path))
    return info


def _checked_shape(tensor: Any, path: Path) -> tuple[int, ...]:
    """The tensor's shape (row-major); ModelLoadError for an unsupported type, a wrong byte size or bad scales."""
    qtype = tensor.tensor_type
    if qtype not in SUPPORTED_TYPES:
        name = getattr(qtype, "name", str(qtype))
        raise ModelLoadError(f"{path}: tensor {tensor.name!r} has unsupported type {name} "
                             f"(supported: {', '.join(t.name for t in SUPPORTED_TYPES)})")
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    num_elements = int(np.prod(shape))
    if (num_elements % block_size or (shape and shape[-1] % block_size)
            or tensor.data.nbytes != num_elements // block_size * type_size):
        raise ModelLoadError(f"{path}: tensor {tensor.name!r} ({qtype.name}, shape {list(shape)}) has "
                             f"{tensor.data.nbytes} bytes of data; the file is truncated or corrupt")
    if qtype in UNPACKED_TYPES:
        try:
            check_scales(np.asarray(tensor.data, dtype=np.uint8).reshape(-1, type_size), qtype)
        except ValueError as e:
            raise ModelLoadError(f"{path}: tensor {tensor.name!r} ({qtype.name}) is corrupt: {e}") from None
    return shape


def dequantize_tensor(tensor: Any, path: Path) -> np.ndarray:
    """One GGUF tensor as float32 in numpy (row-major, llama.cpp's dims reversed) order."""
    shape = _checked_shape(tensor, path)
    try:
        data = dequantize(tensor.data, tensor.tensor_type)  # a new writable array, never the file map
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot dequantize tensor {tensor.name!r} ({tensor.tensor_type.name}): "
                             f"{e}") from None
    return data.reshape(shape)


def unpack_tensor(tensor: Any, path: Path) -> QuantizedWeight:
    """One 2-D GGUF tensor of a type in UNPACKED_TYPES as codes and scales (models/gguf_unpack.py); a 3-D one
    (stacked experts [E, N, K]) as its E * N rows."""
    shape = _checked_shape(tensor, path)
    if len(shape) not in (2, 3):
        raise ModelLoadError(f"{path}: tensor {tensor.name!r} has shape {list(shape)}, expected a matrix")
    try:
        return unpack(tensor.data, tensor.tensor_type, (int(np.prod(shape[:-1])), shape[-1]))
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensor {tensor.name!r} ({tensor.tensor_type.name}) is corrupt: {e}") from None


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of Q/K rows: per head, rows (2, D/2) -> (D/2, 2) interleave."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def layer_names(arch: str) -> dict[str, str]:
    """llama.cpp layer tensor name -> Hugging Face module name, for a general.architecture."""
    return {**_LAYER_NAMES, **GGUF_ARCHITECTURES[arch].layer_names}


def hf_name(gguf_name: str, names: dict[str, str] | None = None) -> str | None:
    """Hugging Face name for a llama.cpp tensor name (`names`: the architecture's layer tensor names, layer_names(arch);
    default Llama's); None when the name is not a weight of a Llama-shaped model."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = names or _LAYER_NAMES
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in names:
        return None
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def runs_quantized(hf_weight_name: str) -> bool:
    """Whether a weight is one a kernel can use quantized: a linear layer's or the token embedding."""
    return hf_weight_name.endswith("_proj.weight") or hf_weight_name in ("model.embed_tokens.weight",
                                                                         "lm_head.weight")


def gguf_tensors(reader: GGUFFile, info: ModelInfo, path: Path, quantized: bool = False,
                 keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, np.ndarray | QuantizedWeight]]:
    """Yield (Hugging Face name, weight) for every tensor (`keep`: only those whose name it accepts, the others
    never read: a pipeline stage's), Q/K rotary permutation undone where the architecture has it.

    A weight is a float32 array, or with `quantized` a QuantizedWeight where the tensor's type is in
    UNPACKED_TYPES and `runs_quantized(name)`.
    """
    arch = reader.metadata["general.architecture"]
    permuted, names = GGUF_ARCHITECTURES[arch].rotary_permuted, layer_names(arch)
    for tensor in reader.tensors:
        if tensor.name in _ROPE_TENSORS:
            continue  # folded into ModelInfo (rope_freq_factors, rope_scaling)
        name = hf_name(tensor.name, names)
        if name is None:
            raise ModelLoadError(f"{path}: unexpected tensor {tensor.name!r} for a {info.architecture} model")
        if keep is not None and not keep(name):
            continue
        if quantized and tensor.tensor_type in UNPACKED_TYPES and runs_quantized(name):
            w: np.ndarray | QuantizedWeight = unpack_tensor(tensor, path)
        else:
            w = dequantize_tensor(tensor, path)
        if permuted and ".q_proj." in name:
            w = _unpermute(w, info.num_heads)
        elif permuted and ".k_proj." in name:
            w = _unpermute(w, info.num_kv_heads)
        if ".experts." in name:
            yield from _per_expert(name, w, int(tensor.shape[-1]) if len(tensor.shape) == 3 else 0, path)
        else:
            yield name, w


def _per_expert(name: str, w: np.ndarray | QuantizedWeight, num_experts: int, path: Path
                ) -> Iterator[tuple[str, np.ndarray | QuantizedWeight]]:
    """A stacked expert tensor [E, N, K] (quantized: its E * N rows) as E weights [N, K] named
    `...experts.{e}.{proj}.weight`."""
    if num_experts < 1:
        raise ModelLoadError(f"{path}: {name} is not a stack of experts (shape {list(w.shape)})")
    rows = w.shape[0] // num_experts if isinstance(w, QuantizedWeight) else w.shape[1]
    for e in range(num_experts):
        expert = name.replace(".experts.", f".experts.{e}.")
        if isinstance(w, QuantizedWeight):
            yield expert, w.map_rows(lambda a, e=e: a[e * rows:(e + 1) * rows])
        else:
            yield expert, w[e]


def _unpermute(w: np.ndarray | QuantizedWeight, num_heads: int) -> np.ndarray | QuantizedWeight:
    if isinstance(w, QuantizedWeight):
        return w.map_rows(lambda rows: unpermute_qk(rows, num_heads))
    return unpermute_qk(w, num_heads)
