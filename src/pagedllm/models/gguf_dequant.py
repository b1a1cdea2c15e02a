"""Dequantization of the common GGUF types with torch (vectorized, multi-threaded), bit-identical to
gguf.quants.dequantize, which stays the reference and the fallback for the other types.

gguf's numpy kernels take ~17 ns per weight on Q4_1 (about 2.5 s for SmolLM2-135M on a 2-core CPU);
these take a fraction of that. Block layouts (ggml-common.h), per block of 32 weights:
    Q8_0: d f16 | 32 x int8                 w = q * d
    Q4_0: d f16 | 16 bytes of 4-bit pairs   w = (q - 8) * d
    Q4_1: d f16 | m f16 | 16 bytes          w = q * d + m
A 4-bit byte j holds weight j in its low nibble and weight j + 16 in its high nibble.
Every product and sum is one float32 operation in the same order as gguf's, so results match exactly.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    # [N, type_size] uint8 -> [N, 1] float32 from the fp16 at byte `start` of each block
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # [N, 16] uint8 -> [N, 32] uint8: low nibbles (weights 0..15), then high nibbles (16..31)
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].view(torch.int8).float() * _f16(blocks, 0)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return _f16(blocks, 0) * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _f16(blocks, 2)


_BLOCK_KERNELS = {Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1}


def dequantize(data: np.ndarray, qtype: Q) -> np.ndarray:
    """Raw bytes of one tensor ([nbytes] uint8) -> flat float32 weights (a new, writable array)."""
    raw = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True).reshape(-1))  # own the bytes
    if qtype == Q.F32:
        return raw.view(torch.float32).numpy()
    if qtype == Q.F16:
        return raw.view(torch.float16).float().numpy()
    if qtype == Q.BF16:
        return raw.view(torch.bfloat16).float().numpy()
    kernel = _BLOCK_KERNELS.get(qtype)
    if kernel is None:
        return np.array(gguf_dequantize(data, qtype), dtype=np.float32).reshape(-1)
    type_size = GGML_QUANT_SIZES[qtype][1]
    return kernel(raw.view(-1, type_size)).reshape(-1).numpy()
