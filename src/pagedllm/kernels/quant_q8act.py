"""The 8-bit-activation fast mode's weights and matmul (quant_q8act_cpu.c): GGUF blocks repacked at load into
the kernel's layout, then `linear(x, weight)` quantizes x per row and 32-value block to int8 and multiplies
with integer dot products.

Packing keeps the weights' values exactly (every `d * q + mn` is the same fp32 number gguf's dequantization
gives); only the activations lose precision. Types: Q4_0, Q4_1, Q4_K (4-bit kind), Q5_0, Q5_1, Q5_K (5-bit),
Q8_0 (8-bit). Others (Q6_K, F16, F32...) have no packing here: `packable` says so and the caller keeps its
lossless path.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

from pagedllm.kernels import cpu_kernels

U4, U5, S8 = 0, 1, 2  # the kernel's weight kinds (quant_q8act_cpu.c)
KIND_OF_TYPE = {Q.Q4_0: U4, Q.Q4_1: U4, Q.Q4_K: U4, Q.Q5_0: U5, Q.Q5_1: U5, Q.Q5_K: U5, Q.Q8_0: S8}
BLOCK = 32
GROUP_ROWS = 8  # output rows per 32-byte vector in the kernel: packed weights are padded to a multiple


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
    """Whether the kernel runs here (CPU with AVX2 and FMA, native kernels built)."""
    return _kernel() is not None


def packable(qtype: Q) -> bool:
    return qtype in KIND_OF_TYPE


@dataclass
class PackedBlocks:
    """One tensor's weights as the kernel reads them, unpadded numpy arrays over rows n of [N, K]."""
    kind: int
    qs: np.ndarray  # [N, K/32, 16] uint8 (U4, U5) or [N, K/32, 32] int8 (S8)
    qh: np.ndarray | None  # [N, K/32] uint32, fifth bits (U5)
    d: np.ndarray  # [N, K/32] float32
    mn: np.ndarray | None  # [N, K/32] float32 (U4, U5)

    def rows(self, index: np.ndarray) -> PackedBlocks:
        """The same weights with rows reordered (llama.cpp's Q/K rotary permutation undone)."""
        pick = [None if a is None else a[index] for a in (self.qs, self.qh, self.d, self.mn)]
        return PackedBlocks(self.kind, *pick)

    def as_u5(self) -> PackedBlocks:
        """A 4-bit weight as a 5-bit one with every fifth bit 0 (to fuse with 5-bit parts)."""
        if self.kind != U4:
            return self
        return PackedBlocks(U5, self.qs, np.zeros(self.d.shape, np.uint32), self.d, self.mn)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[..., start:start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibble_pairs(values: np.ndarray) -> np.ndarray:
    # [..., 32] uint8 values < 16 -> [..., 16] bytes in ggml's order: value j low, value j + 16 high
    return (values[..., :16] | (values[..., 16:] << 4)).astype(np.uint8)


def _bits_u32(bits: np.ndarray) -> np.ndarray:
    # [..., 32] 0/1 -> [...] uint32 with bit j = bits[..., j]
    return (bits.astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(-1, dtype=np.uint32)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # Q4_K / Q5_K super-block [.., 256 values] -> per 32-value sub-block d * sc and -(dmin * m), float32 [.., 8]
    d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]
    s = blocks[..., 4:16].reshape(*blocks.shape[:-1], 3, 4)
    lo, hi, mix = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1).astype(np.float32)
    m = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1).astype(np.float32)
    return d * sc, -(dmin * m)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    # [.., 128] bytes of a K super-block -> [.., 8, 32] 4-bit values: 64-value chunk j holds sub-block 2j in the
    # low nibbles of its 32 bytes and sub-block 2j + 1 in the high nibbles
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (chunks & 0x0F).reshape(*qs.shape[:-1], 8, 32)


def pack_gguf(raw: np.ndarray, qtype: Q, n: int, k: int) -> PackedBlocks:
    """Raw bytes of a GGUF tensor of `n` rows of `k` weights -> PackedBlocks (exact: same fp32 weights)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if k % block_size or np.asarray(raw).nbytes != n * k // block_size * type_size:
        raise ValueError(f"{qtype.name} tensor [{n}, {k}]: {np.asarray(raw).nbytes} bytes do not hold its blocks")
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n, k // block_size, type_size)
    if qtype == Q.Q8_0:
        return PackedBlocks(S8, blocks[..., 2:].copy().view(np.int8), None, _f16(blocks, 0), None)
    if qtype in (Q.Q4_0, Q.Q5_0):
        d = _f16(blocks, 0)
        mn = d * np.float32(-8 if qtype == Q.Q4_0 else -16)  # exact: a power-of-two multiple
        if qtype == Q.Q4_0:
            return PackedBlocks(U4, blocks[..., 2:].copy(), None, d, mn)
        return PackedBlocks(U5, blocks[..., 6:].copy(), blocks[..., 2:6].copy().view(np.uint32)[..., 0], d, mn)
    if qtype == Q.Q4_1:
        return PackedBlocks(U4, blocks[..., 4:].copy(), None, _f16(blocks, 0), _f16(blocks, 2))
    if qtype == Q.Q5_1:
        return PackedBlocks(U5, blocks[..., 8:].copy(), blocks[..., 4:8].copy().view(np.uint32)[..., 0],
                            _f16(blocks, 0), _f16(blocks, 2))
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, mn = _k_scales(blocks)  # [n, k/256, 8]
        low = _k_low_nibbles(blocks[..., -128:])  # [n, k/256, 8, 32]
        sub = (n, k // BLOCK)
        qh = None
        if qtype == Q.Q5_K:
            high = blocks[..., 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
            qh = _bits_u32(high & 1).reshape(sub)
        return PackedBlocks(U4 if qh is None else U5, _nibble_pairs(low).reshape(*sub, 16), qh,
                            d.reshape(sub), mn.reshape(sub))
    raise ValueError(f"no 8-bit-activation packing for {qtype.name}")


def dequantize_packed(p: PackedBlocks) -> np.ndarray:
    """The packed weights as float32 [N, K] (for tests: equal to gguf's dequantization)."""
    q = _values(p).astype(np.float32)
    w = q * p.d[..., None] if p.mn is None else q * p.d[..., None] + p.mn[..., None]
    return w.reshape(p.d.shape[0], -1)


def fuse(parts: list[PackedBlocks]) -> PackedBlocks | None:
    """Concatenate parts along the rows (qkv, gate/up); None when their kinds cannot share one kernel."""
    if len({p.kind for p in parts}) > 1:
        parts = [p.as_u5() for p in parts]
        if len({p.kind for p in parts}) > 1:
            return None

    def cat(field: str) -> np.ndarray | None:
        arrays = [getattr(p, field) for p in parts]
        return None if arrays[0] is None else np.concatenate(arrays)

    return PackedBlocks(parts[0].kind, cat("qs"), cat("qh"), cat("d"), cat("mn"))


def _values(p: PackedBlocks) -> np.ndarray:
    # [N, K/32, 32] codes: uint8 in [0, 31] (U4, U5) or int8 (S8)
    if p.kind == S8:
        return p.qs
    q = np.concatenate([p.qs & 0x0F, p.qs >> 4], axis=-1)
    if p.qh is not None:
        q |= (((p.qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
    return q


class Q8ActWeight:
    """A packed weight in the kernel's interleaved layout (quant_q8act_cpu.c): rows in groups of 8, each block's
    codes as 4-byte quads per row so one 32-byte vector feeds 8 outputs."""

    def __init__(self, p: PackedBlocks):
        n, nb = p.d.shape
        groups = -(-n // GROUP_ROWS)
        pad = groups * GROUP_ROWS - n

        def grouped(a: np.ndarray) -> np.ndarray:  # [N, nb, ...] -> [G, nb, 8, ...]
            a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
            return a.reshape(groups, GROUP_ROWS, *a.shape[1:]).swapaxes(1, 2)

        quads = grouped(_values(p).reshape(n, nb, 8, 4)).swapaxes(2, 3)  # [G, nb, quad, row, 4]
        if p.kind == S8:
            wq = quads.view(np.uint8).reshape(groups, nb, -1)
        else:
            low = quads & 0x0F
            parts = [(low[:, :, :4] | (low[:, :, 4:] << 4)).reshape(groups, nb, -1)]
            if p.kind == U5:
                fifth = (quads >> 4).astype(np.uint8) << np.arange(8, dtype=np.uint8).reshape(8, 1, 1)
                parts.append(np.bitwise_or.reduce(fifth, axis=2).reshape(groups, nb, -1))
            wq = np.concatenate(parts, axis=-1)
        self.kind = p.kind
        self.out_features, self.in_features = n, nb * BLOCK
        self.wq = torch.from_numpy(np.ascontiguousarray(wq))
        self.d = torch.from_numpy(np.ascontiguousarray(grouped(p.d)))
        self.mn = None if p.mn is None else torch.from_numpy(np.ascontiguousarray(grouped(p.mn)))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.wq, self.d, self.mn) if t is not None)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def linear(x: torch.Tensor, w: Q8ActWeight) -> torch.Tensor:
    """x [T, K] float32 -> [T, N] float32, x quantized per row and block of 32 to int8 (llama.cpp's Q8 scheme)."""
    lib = _kernel()
    assert lib is not None and x.dtype == torch.float32 and x.shape[-1] == w.in_features
    x2 = x.reshape(-1, w.in_features).contiguous()
    out = x2.new_empty(x2.shape[0], w.out_features)
    rc = lib.q8act_linear_f32(w.kind, w.wq.data_ptr(), w.d.data_ptr(), _ptr(w.mn), w.out_features, w.in_features,
                              x2.data_ptr(), x2.shape[0], out.data_ptr())
    if rc != 0:
        raise MemoryError("8-bit-activation linear could not allocate its scratch buffers")
    return out.reshape(*x.shape[:-1], w.out_features)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (qa [M, K] int8, da [M, K/32], sa [M, K/32]): the kernel's activation quantization."""
    lib = _kernel()
    assert lib is not None and x.dtype == torch.float32 and x.shape[-1] % BLOCK == 0
    x = x.contiguous()
    m, k = x.shape
    qa = torch.empty(m, k, dtype=torch.int8)
    da, sa = torch.empty(m, k // BLOCK), torch.empty(m, k // BLOCK)
    lib.q8act_quantize_f32(x.data_ptr(), m, k, qa.data_ptr(), da.data_ptr(), sa.data_ptr())
    return qa, da, sa
