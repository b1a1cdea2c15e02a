"""GGUF quantized blocks -> integer codes with one fp32 scale and offset per group of weights, such that

    fma(float(code), scale, offset) == gguf.quants.dequantize(...)   (the same fp32 value, for every weight)

so a kernel that decodes codes in registers multiplies exactly the weights the dequantize-at-load path does.
Each type's value is one rounding of an exact expression (checked by tests/models/test_gguf_unpack.py):

    type   group  code      scale          offset         gguf's value
    Q8_0    32    q int8    d              0              q * d                (exact)
    Q4_0    32    q 0..15   d              -8 d           (q - 8) * d          (exact)
    Q4_1    32    q 0..15   d              m              q * d + m            (q * d exact, one rounding)
    Q5_0    32    q 0..31   d              -16 d          (q - 16) * d         (exact)
    Q5_1    32    q 0..31   d              m              q * d + m
    Q4_K    32    q 0..15   d * sc         -(dmin * mn)   (d * sc) * q - dmin * mn (products exact)
    Q5_K    32    q 0..31   d * sc         -(dmin * mn)   the same
    Q6_K    16    q 0..63   d * sc         -32 (d * sc)   (d * sc) * (q - 32)  (fma rounds the exact value once)

d, m, dmin are fp16 fields, sc / mn the 6-bit (K-quants) or int8 (Q6_K) sub-block scales; the block layouts are
ggml-common.h's (see gguf/quants.py). fp16 scales that are NaN or infinite make the tensor invalid (`check_scales`).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import Q4_K

from pagedllm.models.quantized_codes import QuantizedWeight

# byte offsets of each type's fp16 scale fields inside a block
_FP16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
                Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
UNPACKED_TYPES = tuple(_FP16_FIELDS)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    # [B, type_size] uint8 -> [B, 1] float32 from the fp16 at byte `start` of each block
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # [B, n] uint8 -> [B, 2, n]: low nibbles, then high nibbles
    return np.stack([qs & 15, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    # [B, 4] uint8 (a little-endian uint32) -> [B, count] bit j of it, as uint8
    return np.unpackbits(qh, axis=1, bitorder="little")[:, :count]


def check_scales(blocks: np.ndarray, qtype: Q) -> None:
    """ValueError when a block's fp16 scale or min is NaN or infinite (corrupt data that would poison every step)."""
    for start in _FP16_FIELDS.get(qtype, ()):
        values = _f16(blocks, start)
        if not np.isfinite(values).all():
            bad = int(np.flatnonzero(~np.isfinite(values.reshape(-1)))[0])
            raise ValueError(f"block {bad} has a non-finite fp16 scale ({values.reshape(-1)[bad]}) at byte {start}")


def _per_group(x: np.ndarray, n: int) -> np.ndarray:
    # [B, g] or [B, 1] float32 -> [B, n] (one value per group)
    return np.broadcast_to(x, (x.shape[0], n)).astype(np.float32)


def _unpack_blocks(b: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """[B, type_size] blocks -> codes [B, block_size] int8, scales and offsets [B, groups] float32, group, bits."""
    nb = b.shape[0]
    if qtype == Q.Q8_0:
        d = _f16(b, 0)
        return b[:, 2:].view(np.int8), d, np.zeros_like(d), 32, 8
    if qtype in (Q.Q4_0, Q.Q4_1):
        d = _f16(b, 0)
        start = 2 if qtype == Q.Q4_0 else 4
        offset = d * np.float32(-8) if qtype == Q.Q4_0 else _f16(b, 2)
        return _nibbles(b[:, start:]).reshape(nb, 32).view(np.int8), d, offset, 32, 4
    if qtype in (Q.Q5_0, Q.Q5_1):
        d = _f16(b, 0)
        start = 2 if qtype == Q.Q5_0 else 4
        offset = d * np.float32(-16) if qtype == Q.Q5_0 else _f16(b, 2)
        low = _nibbles(b[:, start + 4:]).reshape(nb, 32)
        codes = low | (_high_bits(b[:, start:start + 4], 32) << 4)
        return codes.view(np.int8), d, offset, 32, 8
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, mn = Q4_K.get_scale_min(b[:, 4:16])  # [B, 8] each
        scale = d * sc.astype(np.float32)
        offset = -(dmin * mn.astype(np.float32))
        if qtype == Q.Q4_K:
            qs = b[:, 16:].reshape(nb, 4, 32)
            codes = np.stack([qs & 15, qs >> 4], axis=2)  # [B, chunk, low/high, 32]: groups 2c, 2c + 1
            return codes.reshape(nb, 256).view(np.int8), scale, offset, 32, 4
        qh = b[:, 16:48]  # bit j of byte e: the high bit of element e of group j
        high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [B, 8, 32]
        low = np.stack([b[:, 48:].reshape(nb, 4, 32) & 15, b[:, 48:].reshape(nb, 4, 32) >> 4], axis=2)
        codes = low.reshape(nb, 8, 32) | (high << 4)
        return codes.reshape(nb, 256).view(np.int8), scale, offset, 32, 8
    if qtype == Q.Q6_K:
        ql, qh = b[:, :128].reshape(nb, 2, 64), b[:, 128:192].reshape(nb, 2, 32)
        low = np.stack([ql & 15, ql >> 4], axis=2).reshape(nb, 8, 32)  # [B, half, low/high, 64] -> groups of 32
        high = (qh[:, :, None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
        codes = low | (high.reshape(nb, 8, 32) << 4)
        scale = _f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)  # [B, 16]
        return codes.reshape(nb, 256).view(np.int8), scale, scale * np.float32(-32), 16, 8
    raise ValueError(f"no unpacker for {qtype.name}")


def unpack(data: np.ndarray, qtype: Q, shape: tuple[int, int]) -> QuantizedWeight:
    """Raw bytes of one [N, K] tensor (K a multiple of the block size) -> QuantizedWeight; ValueError if invalid."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n, k = shape
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, type_size)
    check_scales(blocks, qtype)
    codes, scale, offset, group, bits = _unpack_blocks(blocks, qtype)
    groups_per_block = block_size // group
    scale, offset = _per_group(scale, groups_per_block), _per_group(offset, groups_per_block)
    return QuantizedWeight(codes=np.ascontiguousarray(codes).reshape(n, k), scales=scale.reshape(n, k // group),
                           offsets=offset.reshape(n, k // group), group=group, bits=bits, qtypes=(qtype.name,))
