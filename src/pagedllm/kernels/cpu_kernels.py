"""Build and load the C kernels in this folder.

The sources are compiled once per machine with `cc -O3 -march=native -fopenmp` (side by side: ~10 s on 2
cores) into a cache folder keyed by the source, the flags and the CPU, then loaded with ctypes: no torch headers, no
build step at install time. The library links libgomp by soname, so it shares torch's OpenMP runtime
(and its thread count, `torch.set_num_threads`) instead of starting a second pool.

`PAGEDLLM_NATIVE_KERNELS=0` turns the kernels off (the torch paths run); a failed build, or a library that
lacks a kernel, logs once and falls back the same way.

Loading a library runs its code, so a cached one is loaded only if it and its folder belong to this user and
no one else can write them, and its content has the SHA-256 recorded (in `<name>.sha256`) when it was built;
else it is built again. When the cache folder itself is untrusted (e.g. a world-writable PAGEDLLM_CACHE_DIR),
the library is built into a private temporary folder, loaded from there, and nothing is installed.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pagedllm import envs

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(name)
            for name in ("paged_attention_cpu.c", "kv_cache_cpu.c", "elementwise_cpu.c", "quant_linear_cpu.c",
                         "quant_q8act_cpu.c", "llama_decode_cpu.c", "ngram_cpu.c",
                         "suffix_cpu.c", "shm_all_reduce_cpu.c", "sampling_cpu.c")]
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))  # included by the sources: part of the cache key
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
"""Compile flags. -ffast-math lets gcc call glibc's vector expf (libmvec) in the softmax; it is NOT given when
linking: there it would add crtfastmath.o, whose constructor turns on flush-to-zero and denormals-are-zero for
the whole process when the library loads (Python would then read 5e-324 as 0)."""
_LINK_FLAGS = ["-shared", "-fopenmp", "-lmvec", "-lm"]


def _cache_dir() -> Path | None:
    """The folder of built libraries, `$PAGEDLLM_CACHE_DIR/kernels` (default ~/.cache/pagedllm/kernels); None when
    it cannot be trusted: not owned by this user, or writable by others (anyone who can write there could plant
    a library that this process would load and run)."""
    root = envs.PAGEDLLM_CACHE_DIR or os.path.join(envs.XDG_CACHE_HOME or os.path.expanduser("~/.cache"), "pagedllm")
    path = Path(root) / "kernels"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = _untrusted(path.stat())
    except OSError as e:
        problem = str(e)
    if problem is not None:
        logger.warning("not using the kernel cache %s (%s): building into a private temporary folder", path,
                       problem)
        return None
    return path


def _untrusted(st: os.stat_result) -> str | None:
    """Why a cached file or folder must not be used, or None."""
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not {os.getuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load_cached(target: Path) -> ctypes.CDLL | None:
    """The cached library if it is this user's, writable by no one else, and has the content hash recorded in
    its `.sha256` file when it was built; else None (it is built again)."""
    digest_file = target.with_name(target.name + ".sha256")
    try:
        problem = _untrusted(target.stat()) or _untrusted(digest_file.stat())
        if problem is None and _sha256(target) != digest_file.read_text().strip():
            problem = "its content is not what was built"
    except FileNotFoundError:
        return None
    if problem is not None:
        logger.warning("not loading the cached kernel library %s (%s): building it again", target, problem)
        return None
    return ctypes.CDLL(str(target))


def _build(compiler: str, target_name: str, cache: Path | None) -> ctypes.CDLL:
    """Compile into a fresh private folder and load the result from there; then, with a cache, install it and
    its content hash there for the next process (atomic renames: concurrent builders each install whole files)."""
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # mode 0700
        built = Path(tmp) / target_name
        objects = [str(Path(tmp) / f"{src.stem}.o") for src in _SOURCES]
        _compile_all([[compiler, *_FLAGS, "-c", "-o", obj, str(src)] for src, obj in zip(_SOURCES, objects,
                                                                                        strict=True)])
        subprocess.run([compiler, "-o", str(built), *objects, *_LINK_FLAGS], check=True, capture_output=True,
                       timeout=120)
        digest = _sha256(built)
        lib = ctypes.CDLL(str(built))
        if cache is not None:
            digest_file = Path(tmp) / "digest"
            digest_file.write_text(digest + "\n")
            os.replace(built, cache / target_name)
            os.replace(digest_file, cache / (target_name + ".sha256"))
    return lib


def _compile_all(commands: list[list[str]], timeout_s: float = 120.0) -> None:
    """Run the compiles side by side (one per source; the largest, paged_attention_cpu.c, takes half of the ~20 s
    that compiling them one after another took on a 2-core machine). Raises as subprocess.run(check=True) would,
    after stopping the others."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for cmd in commands]
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _library_name() -> str:
    """The cached library's file name, keyed by the sources, the flags and the CPU."""
    source = b"".join(path.read_bytes() for path in [*_SOURCES, *_HEADERS])
    flags = " ".join(_FLAGS + _LINK_FLAGS).encode()
    key = hashlib.sha256(source + flags + _cpu_signature().encode()).hexdigest()[:16]
    return f"pagedllm_cpu-{key}.so"


@functools.cache
def _library() -> ctypes.CDLL | None:
    if not envs.PAGEDLLM_NATIVE_KERNELS:
        return None
    compiler = shutil.which(envs.CC)
    if compiler is None:
        logger.info("no C compiler found: native CPU kernels off, torch paths used")
        return None
    target_name = _library_name()
    try:
        cache = _cache_dir()
        lib = _load_cached(cache / target_name) if cache is not None else None
        if lib is None:
            lib = _build(compiler, target_name, cache)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("could not build the native CPU kernels (%s %s): torch paths used", e,
                       detail.decode(errors="replace")[-500:])
        return None
    try:
        _declare_attention(lib)
        _declare_elementwise(lib)
        _declare_quant_linear(lib)
        _declare_ngram(lib)
    except AttributeError as e:  # a library without the expected symbols: the torch paths, not a crash
        logger.warning("the native CPU kernel library lacks a kernel (%s): torch paths used", e)
        return None
    return lib


def _declare_attention(lib: ctypes.CDLL) -> None:
    """ctypes signatures of paged_attention_cpu.c's and kv_cache_cpu.c's kernels."""
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    signatures = {
        "paged_decode_attention": (ctypes.c_int, [ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr] + [i64] * 5
                                   + [f32, i32, f32, f32, ptr, i64, f32]),
        "paged_multirow_attention": (ctypes.c_int, [ptr, i64, ptr, ptr, ptr, i64, ptr, i64, ptr, ptr] + [i64] * 4
                                     + [f32, i32, f32, f32, i64, f32]),
        "kv_cache_write": (None, [ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i32, f32, f32, ptr, i64]),
        "kv_encode": (None, [ptr, i64, i32, ptr]),
        "kv_decode": (None, [ptr, i64, i32, i32, ptr]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


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
    lib.categorical_draw_f32.restype = None  # sampling_cpu.c
    lib.categorical_draw_f32.argtypes = [ptr, i64, i64, i64, ptr, ptr]


def require(ok: bool, what: str) -> None:
    """An argument check before a native call: raises ValueError (what: the condition that failed), where an assert
    would vanish under `python -O` and let a bad pointer or shape reach C code."""
    if not ok:
        raise ValueError(f"native kernel argument check failed: {what}")


def _declare_ngram(lib: ctypes.CDLL) -> None:
    """ctypes signatures of ngram_cpu.c's and suffix_cpu.c's proposers."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.ngram_propose.restype = None
    lib.ngram_propose.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, ptr, ptr]
    lib.suffix_propose.restype = None
    lib.suffix_propose.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, ctypes.c_double, ctypes.c_double, ptr, ptr,
                                   ptr, ptr, ptr]


def native_library_available() -> bool:
    """Whether the native library built and loaded (any dtype, CPU-side helpers such as ngram_propose)."""
    return _library() is not None


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the native kernels (decode attention, elementwise ops) can run for this dtype on this device."""
    return device.type == "cpu" and dtype == torch.float32 and _library() is not None


KV_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
"""KV cache storage dtypes the kernels read and write, and their codes in kv_dtype_cpu.h."""


def kv_cache_native(kv_dtype: torch.dtype, compute_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the native KV cache write and decode attention run for fp32 activations over a cache of kv_dtype."""
    return kv_dtype in KV_FORMATS and available(compute_dtype, device)


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, k_scale: float = 1.0,
                           v_scale: float = 1.0, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Decode attention read in place through the block table. A cached K code c stands for c * k_scale, a V code
    for c * v_scale (powers of two: layers/kv_cache_dtype.py). window > 0: each query attends only the last
    `window` tokens of its context (its own included); softcap > 0: scores = softcap * tanh(scores / softcap)
    before the softmax (Gemma 2).

    Args:
        q: [S, H, D] float32, each row contiguous (the row stride may exceed H * D).
        key_cache, value_cache: [num_blocks, block_size, Hkv, D], contiguous, a dtype of KV_FORMATS.
        block_table: [S, max_blocks] int32, contiguous rows (the row stride may exceed the blocks used).
        seq_lens: [S] int32, contiguous: context length of each query, its own token included.
    Returns:
        out: [S, H, D] float32.
    """
    s, h, d = q.shape
    require(q.dtype == torch.float32 and q.stride()[1:] == (d, 1),
            "q.dtype == torch.float32 and q.stride()[1:] == (d, 1)")
    check_decode_args(key_cache, value_cache, block_table, seq_lens)
    return _decode(q, q.stride(0), None, None, key_cache.data_ptr(), value_cache.data_ptr(), key_cache.shape[1:],
                   key_cache.dtype, block_table, seq_lens, scale, h, k_scale, v_scale, None, window, softcap)


def fused_decode_attention(qkv: torch.Tensor, cos_sin: torch.Tensor, slot_mapping: torch.Tensor,
                           kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_heads: int, k_scale: float = 1.0, v_scale: float = 1.0,
                           k_comp: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """One call for a layer's batch of decodes: rotary on q and k in place in qkv (as rotary_qkv does), the K/V
    write at slot_mapping (as write_kv_cache does), then paged_decode_attention (k_scale, v_scale, k_comp, window,
    softcap: as theirs).

    Args:
        qkv: [S, (H + 2 * Hkv) * D] float32, contiguous: the fused qkv projection, not yet rotated.
        cos_sin: [S, 2, D / 2] float32, contiguous (RotaryEmbedding's output).
        slot_mapping: [S] int64, contiguous: the slot of each query's own token.
        kv_cache: [2, num_blocks, block_size, Hkv, D], contiguous: key_cache = kv_cache[0], value_cache = kv_cache[1].
        block_table, seq_lens: as paged_decode_attention's. The caller checks these and the cache once per step
            with check_decode_args: this runs once per layer.
    Returns:
        out: [S, H, D] float32.
    """
    key = kv_cache.data_ptr()
    value = key + kv_cache.stride(0) * kv_cache.element_size()
    return _decode(qkv, qkv.shape[1], cos_sin.data_ptr(), slot_mapping.data_ptr(), key, value, kv_cache.shape[2:],
                   kv_cache.dtype, block_table, seq_lens, scale, num_heads, k_scale, v_scale,
                   _comp_ptr(k_comp, (kv_cache.shape[3], kv_cache.shape[4])), window, softcap)


def _decode(q: torch.Tensor, q_stride: int, cos_sin: int | None, slot_mapping: int | None, key_cache: int,
            value_cache: int, block_shape: torch.Size, kv_dtype: torch.dtype, block_table: torch.Tensor,
            seq_lens: torch.Tensor, scale: float, num_heads: int, k_scale: float, v_scale: float,
            k_comp: int | None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    block_size, hkv, d = block_shape  # of the cache: [block_size, Hkv, D]
    s = q.shape[0]
    out = q.new_empty(s, num_heads, d)
    rc = _library().paged_decode_attention(q.data_ptr(), q_stride, cos_sin, slot_mapping, key_cache, value_cache,
                                           block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(),
                                           out.data_ptr(), s, num_heads, hkv, d, block_size, scale,
                                           KV_FORMATS[kv_dtype], k_scale, v_scale, k_comp, window, softcap)
    if rc != 0:
        raise MemoryError("paged decode attention could not allocate its scratch buffer")
    return out


def check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """The layout every kernel that reads or writes the KV cache assumes of it."""
    require(key_cache.is_contiguous() and value_cache.is_contiguous() and key_cache.dtype == value_cache.dtype
            and key_cache.dtype in KV_FORMATS and key_cache.is_cpu,
            "key and value caches contiguous, on the CPU, one dtype of KV_FORMATS")


def check_decode_args(key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor) -> None:
    """The layouts the decode attention kernel assumes of the cache and the step's metadata."""
    check_cache(key_cache, value_cache)
    require(block_table.is_cpu and seq_lens.is_cpu, "block_table.is_cpu and seq_lens.is_cpu")
    require(block_table.dtype == torch.int32 and block_table.stride(1) == 1,
            "block_table.dtype == torch.int32 and block_table.stride(1) == 1")
    require(seq_lens.dtype == torch.int32 and seq_lens.is_contiguous() and len(seq_lens) == len(block_table),
            "seq_lens.dtype == torch.int32 and seq_lens.is_contiguous() and len(seq_lens) == len(block_table)")


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
                   k_comp: torch.Tensor | None = None) -> None:
    """key_cache[slot_mapping[t]] = k[t] / k_scale (and v / v_scale), encoded in the cache's dtype (round to nearest
    even, saturating); the scales are powers of two, so this is to_cache_dtype's result. k_comp: None, or (fp8
    caches) [Hkv, D, D] float32 error-feedback weights K is rounded with: to_cache_dtype_compensated's result.

    Args:
        k, v: [T, Hkv, D] float32, each row contiguous (rows may be strided: views of a fused qkv).
        key_cache, value_cache: [num_blocks, block_size, Hkv, D], contiguous, a dtype of KV_FORMATS.
        slot_mapping: [T] int64, contiguous.
    """
    lib = _library()
    t, hkv, d = k.shape
    require(k.dtype == v.dtype == torch.float32 and k.stride() == v.stride() and k.stride()[1:] == (d, 1),
            "k.dtype == v.dtype == torch.float32 and k.stride() == v.stride() and k.stride()[1:] == (d, 1)")
    check_cache(key_cache, value_cache)
    require(slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and slot_mapping.shape == (t,),
            "slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and slot_mapping.shape == (t,)")
    lib.kv_cache_write(k.data_ptr(), v.data_ptr(), k.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
                       slot_mapping.data_ptr(), t, hkv * d, KV_FORMATS[key_cache.dtype], k_scale, v_scale,
                       _comp_ptr(k_comp, (hkv, d)), d)


def _comp_ptr(k_comp: torch.Tensor | None, hkv_d: tuple[int, int]) -> int | None:
    """The error-feedback weights' address for the kernels (None: plain rounding), after checking their layout."""
    if k_comp is None:
        return None
    hkv, d = hkv_d
    require(k_comp.dtype == torch.float32 and k_comp.is_contiguous() and k_comp.shape == (hkv, d, d),
            "k_comp.dtype == torch.float32 and k_comp.is_contiguous() and k_comp.shape == (hkv, d, d)")
    return k_comp.data_ptr()


def kv_encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (float32, contiguous) encoded as the KV cache stores it in `dtype`: a new tensor of that dtype."""
    require(x.dtype == torch.float32 and x.is_contiguous(), "x.dtype == torch.float32 and x.is_contiguous()")
    out = torch.empty(x.shape, dtype=dtype)
    _library().kv_encode(x.data_ptr(), x.numel(), KV_FORMATS[dtype], out.data_ptr())
    return out


def kv_decode(codes: torch.Tensor, vector: bool = True) -> torch.Tensor:
    """codes (a KV_FORMATS dtype, contiguous) as float32, through the attention kernel's vector loads (vector)
    or the scalar conversion."""
    require(codes.is_contiguous(), "codes.is_contiguous()")
    out = torch.empty(codes.shape, dtype=torch.float32)
    _library().kv_decode(codes.data_ptr(), codes.numel(), KV_FORMATS[codes.dtype], int(vector), out.data_ptr())
    return out


def _check_f32(*tensors: torch.Tensor) -> None:
    for t in tensors:  # a loop, not all(...): these run ~120 times per decode step
        require(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous(),
                "t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()")


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
    require(lib is not None and weight.shape == (hidden,), "lib is not None and weight.shape == (hidden,)")
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
    require(lib is not None and residual.shape == x.shape and weight.shape == (hidden,),
            "lib is not None and residual.shape == x.shape and weight.shape == (hidden,)")
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
    require(lib is not None and head_dim % 2 == 0 and qkv.shape == (t, (num_heads + 2 * num_kv_heads) * head_dim),
            "lib is not None and head_dim % 2 == 0 and qkv.shape == (t, (num_heads + 2 * num_kv_heads) * head_dim)")
    require(cos_sin.shape == (t, 2, head_dim // 2), "cos_sin.shape == (t, 2, head_dim // 2)")
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
    require(lib is not None and x.shape[-1] == 2 * size, "lib is not None and x.shape[-1] == 2 * size")
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
    require(lib is not None and packed.dtype == torch.uint8 and packed.is_contiguous() and k % group == 0,
            "lib is not None and packed.dtype == torch.uint8 and packed.is_contiguous() and k % group == 0")
    y = x.new_empty(m, out_features)
    lib.quant_linear_f32(packed.data_ptr(), bits, group, x.data_ptr(), y.data_ptr(), m, out_features, k)
    return y


def quant_gather_rows(packed: torch.Tensor, bits: int, group: int, ids: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows `ids` of a packed weight, decoded to float32: [len(ids), in_features] (the embedding lookup).

    ids: [T] int64, every id in [0, out_features) (the caller checks).
    """
    lib = _library()
    require(lib is not None and packed.dtype == torch.uint8 and packed.is_contiguous() and ids.dtype == torch.int64,
            "lib is not None and packed.dtype == torch.uint8 and packed.is_contiguous() and ids.dtype == torch.int64")
    ids = ids.contiguous()
    out = torch.empty(ids.numel(), in_features, dtype=torch.float32)
    lib.quant_gather_rows_f32(packed.data_ptr(), bits, group, ids.data_ptr(), out.data_ptr(), ids.numel(), in_features)
    return out
