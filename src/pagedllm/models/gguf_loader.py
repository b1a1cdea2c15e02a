"""GGUF files: metadata -> ModelInfo, tensors -> dequantized float32 arrays under Hugging Face names.

llama.cpp stores Q and K projections with their rows permuted for its interleaved rotary layout;
`unpermute_qk` undoes that (as transformers' GGUF loader does) so the rotate-half layout applies.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from pagedllm.models.gguf_dequant import dequantize
from pagedllm.models.gguf_reader import GGUFFile
from pagedllm.models.model_info import ModelInfo, ModelLoadError

SUPPORTED_TYPES = tuple(GGMLQuantizationType[name] for name in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"))
# llama.cpp writes Llama, Mistral and SmolLM2 as "llama".
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
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
    scaling = None
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", path, "none")
    if scaling_type == "linear":
        scaling = {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor", path))}
    elif scaling_type != "none":
        raise ModelLoadError(f"{path}: rope scaling {scaling_type!r} is not supported")
    tokens = reader.metadata.get("tokenizer.ggml.tokens")
    eos = [_field(reader, key, path, None) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    freq_factors = None
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        freq_factors = tuple(float(x) for x in dequantize_tensor(rope_freqs, path).reshape(-1))
    info = ModelInfo(
        architecture=GGUF_ARCHITECTURES[arch],
        num_layers=_int_field(reader, f"{arch}.block_count", path),
        hidden_size=hidden,
        intermediate_size=_int_field(reader, f"{arch}.feed_forward_length", path),
        num_heads=num_heads,
        num_kv_heads=_int_field(reader, f"{arch}.attention.head_count_kv", path, num_heads),
        head_dim=_int_field(reader, f"{arch}.attention.key_length", path, hidden // max(num_heads, 1)),
        vocab_size=_int_field(reader, f"{arch}.vocab_size", path, len(tokens) if tokens else 0),
        max_position_embeddings=_int_field(reader, f"{arch}.context_length", path),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", path, 1e-5)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", path, 10000.0)),
        rope_scaling=scaling,
        rope_freq_factors=freq_factors,
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", path, None),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
    )
    info.validate(str(path))
    return info


def dequantize_tensor(tensor: Any, path: Path) -> np.ndarray:
    """One GGUF tensor as float32 in numpy (row-major, llama.cpp's dims reversed) order."""
    qtype = tensor.tensor_type
    if qtype not in SUPPORTED_TYPES:
        name = getattr(qtype, "name", str(qtype))
        raise ModelLoadError(f"{path}: tensor {tensor.name!r} has unsupported type {name} "
                             f"(supported: {', '.join(t.name for t in SUPPORTED_TYPES)})")
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    num_elements = int(np.prod(shape))
    if num_elements % block_size or tensor.data.nbytes != num_elements // block_size * type_size:
        raise ModelLoadError(f"{path}: tensor {tensor.name!r} ({qtype.name}, shape {list(shape)}) has "
                             f"{tensor.data.nbytes} bytes of data; the file is truncated or corrupt")
    try:
        data = dequantize(tensor.data, qtype)  # a new writable array, never the file map
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot dequantize tensor {tensor.name!r} ({qtype.name}): {e}") from None
    return data.reshape(shape)


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of Q/K rows: per head, rows (2, D/2) -> (D/2, 2) interleave."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str | None:
    """Hugging Face name for a llama.cpp tensor name; None when the name is not a Llama weight."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def gguf_tensors(reader: GGUFFile, info: ModelInfo, path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (Hugging Face name, float32 array) for every weight, Q/K rotary permutation undone."""
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            continue  # folded into ModelInfo.rope_freq_factors
        name = hf_name(tensor.name)
        if name is None:
            raise ModelLoadError(f"{path}: unexpected tensor {tensor.name!r} for a llama model")
        w = dequantize_tensor(tensor, path)
        if ".q_proj." in name:
            w = unpermute_qk(w, info.num_heads)
        elif ".k_proj." in name:
            w = unpermute_qk(w, info.num_kv_heads)
        yield name, w
