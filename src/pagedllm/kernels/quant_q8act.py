"""ctypes wrappers of quant_q8act_cpu.c, the 8-bit-activation linear (the fast mode's kernel). The weights'
packed layout is built by layers/int8_activation_weight.py."""

from __future__ import annotations

import ctypes
import functools

import torch

from pagedllm.kernels import cpu_kernels

U4, U5, S8 = 0, 1, 2  # weight kinds: codes 0..15 with an offset, 0..31 with an offset, int8 without
BLOCK = 32  # k's per weight scale and per activation scale


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    lib = cpu_kernels._library()
    if lib is None or not lib.q8act_supported():
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.q8act_linear_f32.restype = ctypes.c_int
    lib.q8act_linear_f32.argtypes = [ctypes.c_int, ptr, ptr, ptr, i64, i64, ptr, i64, ptr]
    lib.q8act_quantize_f32.restype = None
    lib.q8act_quantize_f32.argtypes = [ptr, i64, i64, ptr, ptr, ptr]
    return lib


def available() -> bool:
    """Whether the kernel runs here (native kernels built, CPU with AVX2 and FMA)."""
    return _kernel() is not None


def q8act_linear(kind: int, wq: torch.Tensor, d: torch.Tensor, mn: torch.Tensor | None, out_features: int,
                 x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 (contiguous) -> [M, N] float32 with x quantized per row and 32-block to int8.

    Args: the packed weight of quant_q8act_cpu.c: wq uint8 codes, d (and mn for U4/U5) [groups, K / 32, 8] f32.
    """
    lib = _kernel()
    cpu_kernels.require(lib is not None and x.dtype == torch.float32 and x.is_contiguous() and x.dim() == 2,
                        "lib is not None and x.dtype == torch.float32 and x.is_contiguous() and x.dim() == 2")
    out = x.new_empty(x.shape[0], out_features)
    rc = lib.q8act_linear_f32(kind, wq.data_ptr(), d.data_ptr(), None if mn is None else mn.data_ptr(), out_features,
                              x.shape[1], x.data_ptr(), x.shape[0], out.data_ptr())
    if rc != 0:
        raise MemoryError("8-bit-activation linear could not allocate its scratch buffers")
    return out


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (qa [M, K] int8, da [M, K/32], sa [M, K/32]): the kernel's activation quantization."""
    lib = _kernel()
    cpu_kernels.require(lib is not None and x.dtype == torch.float32 and x.shape[-1] % BLOCK == 0,
                        "lib is not None and x.dtype == torch.float32 and x.shape[-1] % BLOCK == 0")
    x = x.contiguous()
    m, k = x.shape
    qa = torch.empty(m, k, dtype=torch.int8)
    da, sa = torch.empty(m, k // BLOCK), torch.empty(m, k // BLOCK)
    lib.q8act_quantize_f32(x.data_ptr(), m, k, qa.data_ptr(), da.data_ptr(), sa.data_ptr())
    return qa, da, sa
