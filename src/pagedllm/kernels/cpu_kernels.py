"""Build and load the C kernels in this folder.

The sources are compiled once per machine with `cc -O3 -march=native -fopenmp` (well under a second) into
a cache folder keyed by the source, the flags and the CPU, then loaded with ctypes: no torch headers, no
build step at install time. The library links libgomp by soname, so it shares torch's OpenMP runtime
(and its thread count, `torch.set_num_threads`) instead of starting a second pool.

`PAGEDLLM_NATIVE_KERNELS=0` turns the kernels off (the torch paths run); a failed build logs once and
falls back the same way.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(name) for name in ("paged_attention_cpu.c", "elementwise_cpu.c",
                                                             "quant_linear_cpu.c", "quant_q8act_cpu.c")]
_HEADER = Path(__file__).with_name("simd_cpu.h")  # included by the sources: part of the cache key
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
"""Compile flags. -ffast-math lets gcc call glibc's vector expf (libmvec) in the softmax; it is NOT given when
linking: there it would add crtfastmath.o, whose constructor turns on flush-to-zero and denormals-are-zero for
the whole process when the library loads (Python would then read 5e-324 as 0)."""
_LINK_FLAGS = ["-shared", "-fopenmp", "-lmvec", "-lm"]


def _cache_dir() -> Path:
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedllm")
    path = Path(root) / "kernels"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("PAGEDLLM_NATIVE_KERNELS", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.info("no C compiler found: native CPU kernels off, torch paths used")
        return None
    source = b"".join(path.read_bytes() for path in [*_SOURCES, _HEADER])
    flags = " ".join(_FLAGS + _LINK_FLAGS).encode()
    key = hashlib.sha256(source + flags + _cpu_signature().encode()).hexdigest()[:16]
    try:
        target = _cache_dir() / f"pagedllm_cpu-{key}.so"
        if not target.exists():
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                objects = [str(Path(tmp) / f"{src.stem}.o") for src in _SOURCES]
                for src, obj in zip(_SOURCES, objects, strict=True):
                    subprocess.run([compiler, *_FLAGS, "-c", "-o", obj, str(src)], check=True, capture_output=True,
                                   timeout=120)
                subprocess.run([compiler, "-o", str(built), *objects, *_LINK_FLAGS], check=True,
                               capture_output=True, timeout=120)
                os.replace(built, target)  # atomic: concurrent builders each install a whole file
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("could not build the native CPU kernels (%s %s): torch paths used", e,
                       detail.decode(errors="replace")[-500:])
        return None
    fn = lib.paged_decode_attention_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] \
        + [ctypes.c_int64] * 5 + [ctypes.c_float]
    _declare_elementwise(lib)
    _declare_quant_linear(lib)
    return lib


def _declare_elementwise(lib: ctypes.CDLL) -> None:
    """ctypes signatures of elementwise_cpu.c's kernels (they return nothing)."""
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    signatures = {
        "rms_norm_f32": [ptr, ptr, ptr, i64, i64, f32],
        "fused_add_rms_norm_f32": [ptr, ptr, ptr, i64, i64, f32],
        "rotary_qkv_f32": [ptr, ptr, i64, i64, i64, i64],
        "silu_and_mul_f32": [ptr, ptr, i64, i64],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = argtypes


def _declare_quant_linear(lib: ctypes.CDLL) -> None:
    """ctypes signatures of quant_linear_cpu.c's kernels (they return nothing)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.quant_linear_f32.restype = None
    lib.quant_linear_f32.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64]
    lib.quant_gather_rows_f32.restype = None
    lib.quant_gather_rows_f32.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64]


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the native kernels (decode attention, elementwise ops) can run for this dtype on this device."""
    return device.type == "cpu" and dtype == torch.float32 and _library() is not None


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention read in place through the block table.

    Args:
        q: [S, H, D] float32, contiguous.
        key_cache, value_cache: [num_blocks, block_size, Hkv, D] float32, contiguous.
        block_table: [S, max_blocks] int32, contiguous rows (the row stride may exceed the blocks used).
        seq_lens: [S] int32: context length of each query, its own token included.
    Returns:
        out: [S, H, D] float32.
    """
    lib = _library()
    assert lib is not None and q.is_contiguous() and key_cache.is_contiguous() and value_cache.is_contiguous()
    assert block_table.dtype == torch.int32 and block_table.stride(1) == 1 and seq_lens.dtype == torch.int32
    s, h, d = q.shape
    num_blocks, block_size, hkv, _ = key_cache.shape
    out = torch.empty_like(q)
    seq_lens = seq_lens.contiguous()
    rc = lib.paged_decode_attention_f32(q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                                        block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(),
                                        out.data_ptr(), s, h, hkv, d, block_size, scale)
    if rc != 0:
        raise MemoryError("paged decode attention could not allocate its scratch buffer")
    return out


def _check_f32(*tensors: torch.Tensor) -> None:
    for t in tensors:  # a loop, not all(...): these run ~120 times per decode step
        assert t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight.

    Args:
        x: [T, hidden] float32, contiguous (any leading shape; rows are the last dimension).
        weight: [hidden] float32, contiguous.
    Returns:
        out: a new tensor shaped like x.
    """
    lib = _library()
    _check_f32(x, weight)
    hidden = x.shape[-1]
    assert lib is not None and weight.shape == (hidden,)
    out = x.new_empty(x.shape)
    lib.rms_norm_f32(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // hidden, hidden, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place, as vLLM's fused_add_rms_norm: residual = x + residual; x = rms_norm(residual) * weight.

    Args:
        x, residual: [T, hidden] float32, contiguous, same shape, not overlapping; both are overwritten.
        weight: [hidden] float32, contiguous.
    """
    lib = _library()
    _check_f32(x, residual, weight)
    hidden = x.shape[-1]
    assert lib is not None and residual.shape == x.shape and weight.shape == (hidden,)
    lib.fused_add_rms_norm_f32(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.numel() // hidden, hidden,
                               eps)


def rotary_qkv(qkv: torch.Tensor, cos_sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Rotary embedding (rotate-half layout) in place on the q and k heads of a fused qkv projection.

    Args:
        qkv: [T, (num_heads + 2 * num_kv_heads) * head_dim] float32, contiguous: q, k, v heads; v is not changed.
        cos_sin: [T, 2, head_dim / 2] float32, contiguous: each token's cos and sin (RotaryEmbedding's output).
    """
    lib = _library()
    _check_f32(qkv, cos_sin)
    t = qkv.shape[0]
    assert lib is not None and head_dim % 2 == 0 and qkv.shape == (t, (num_heads + 2 * num_kv_heads) * head_dim)
    assert cos_sin.shape == (t, 2, head_dim // 2)
    lib.rotary_qkv_f32(qkv.data_ptr(), cos_sin.data_ptr(), t, num_heads, num_kv_heads, head_dim)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up].

    Args:
        x: [T, 2 * I] float32, contiguous.
    Returns:
        out: [T, I] float32, a new tensor.
    """
    lib = _library()
    _check_f32(x)
    size = x.shape[-1] // 2
    assert lib is not None and x.shape[-1] == 2 * size
    out = x.new_empty(*x.shape[:-1], size)
    lib.silu_and_mul_f32(x.data_ptr(), out.data_ptr(), out.numel() // size if size else 0, size)
    return out


def quant_linear(packed: torch.Tensor, bits: int, group: int, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """x @ W^T for a weight packed by layers/quantized_weight.py (its docstring has the layout).

    Args:
        packed: uint8, contiguous: the panels of W [out_features, K].
        x: [M, K] float32, contiguous.
    Returns:
        y: [M, out_features] float32, a new tensor.
    """
    lib = _library()
    _check_f32(x)
    m, k = x.shape
    assert lib is not None and packed.dtype == torch.uint8 and packed.is_contiguous() and k % group == 0
    y = x.new_empty(m, out_features)
    lib.quant_linear_f32(packed.data_ptr(), bits, group, x.data_ptr(), y.data_ptr(), m, out_features, k)
    return y


def quant_gather_rows(packed: torch.Tensor, bits: int, group: int, ids: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows `ids` of a packed weight, decoded to float32: [len(ids), in_features] (the embedding lookup).

    ids: [T] int64, every id in [0, out_features) (the caller checks).
    """
    lib = _library()
    assert lib is not None and packed.dtype == torch.uint8 and packed.is_contiguous() and ids.dtype == torch.int64
    ids = ids.contiguous()
    out = torch.empty(ids.numel(), in_features, dtype=torch.float32)
    lib.quant_gather_rows_f32(packed.data_ptr(), bits, group, ids.data_ptr(), out.data_ptr(), ids.numel(), in_features)
    return out
