"""A GGUF weight packed for the 8-bit-activation fast mode (`activation_quantization="int8"`): multiplied by
kernels/quant_q8act_cpu.c, which quantizes each activation row per 32 k's to int8 (llama.cpp's Q8 scheme) and
takes integer dot products. The weights keep their exact values (codes, scales and offsets of
models/quantized_codes.QuantizedWeight); only the activations lose precision.

It has PackedWeight's interface (shape, nbytes, qtypes, matmul, rows, dequantize), so Linear and VocabEmbedding
take either. Kinds: U4 (4-bit codes + offset: Q4_0, Q4_1, Q4_K), U5 (codes 0..31 + offset: Q5_0, Q5_1, Q5_K),
S8 (int8 codes, no offset: Q8_0); all with one scale per 32 k's. Others (Q6_K's 16-k groups, float weights)
have no packing here: `from_quantized` returns None and the caller keeps the lossless PackedWeight.

Layout (see the C file): output rows in groups of 8, per group and 32-k block the codes as 4-byte quads per row,
  U4: 128 bytes, load j (32 bytes) = quads j (low nibbles) and j + 4 (high nibbles), lane r = row r's quad
  U5: those + 32 bytes of fifth bits (byte (r, t), bit q: k = 4q + t)
  S8: 256 bytes, quad q lane r = row r's k's 4q .. 4q + 3
and d, mn [groups, K / 32, 8] float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.kernels.quant_q8act import BLOCK, S8, U4, U5, q8act_linear
from pagedllm.math_utils import cdiv

if TYPE_CHECKING:
    from pagedllm.models.quantized_codes import QuantizedWeight

ROWS = 8  # output rows per group (one 8-lane vector)


def _kind(w: QuantizedWeight) -> int | None:
    if w.group != BLOCK:
        return None
    if w.bits == 4:
        return U4
    if not w.offsets.any():
        return S8
    codes = w.codes.view(np.uint8)
    return U5 if int(codes.max(initial=0)) <= 31 else None


class Int8ActivationWeight:
    def __init__(self, w: QuantizedWeight, kind: int):
        n, k = w.shape
        nb, groups = k // BLOCK, cdiv(n, ROWS)
        pad = groups * ROWS - n

        def grouped(a: np.ndarray) -> np.ndarray:  # [N, nb, ...] -> [G, nb, 8, ...]
            a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
            return a.reshape(groups, ROWS, *a.shape[1:]).swapaxes(1, 2)

        quads = grouped(w.codes.view(np.uint8).reshape(n, nb, 8, 4)).swapaxes(2, 3)  # [G, nb, quad, row, 4]
        if kind == S8:
            wq = quads.reshape(groups, nb, -1)
        else:
            low = quads & 0x0F
            parts = [(low[:, :, :4] | (low[:, :, 4:] << 4)).reshape(groups, nb, -1)]
            if kind == U5:
                fifth = (quads >> 4) << np.arange(8, dtype=np.uint8).reshape(8, 1, 1)
                parts.append(np.bitwise_or.reduce(fifth, axis=2).reshape(groups, nb, -1))
            wq = np.concatenate(parts, axis=-1)
        self.kind, self.out_features, self.in_features, self.qtypes = kind, n, k, w.qtypes
        self.wq = torch.from_numpy(np.ascontiguousarray(wq))
        self.d = torch.from_numpy(np.ascontiguousarray(grouped(w.scales.astype(np.float32))))
        self.mn = None if kind == S8 else torch.from_numpy(np.ascontiguousarray(grouped(w.offsets.astype(np.float32))))

    @classmethod
    def from_quantized(cls, w: QuantizedWeight) -> Int8ActivationWeight | None:
        """The weight packed for the fast mode, or None when its type has no 8-bit-activation kernel."""
        kind = _kind(w)
        return None if kind is None else cls(w, kind)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.wq, self.d, self.mn) if t is not None)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T with x quantized to 8 bits: x [..., K] float32 -> [..., N] float32."""
        x2 = x.reshape(-1, self.in_features).contiguous()
        y = q8act_linear(self.kind, self.wq, self.d, self.mn, self.out_features, x2)
        return y.reshape(*x.shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Decoded rows W[ids] (exact weight values: the embedding lookup): ids [...] int64 -> [..., K] float32."""
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.out_features):
            raise IndexError(f"index out of range for a weight of {self.out_features} rows")
        g, r = flat // ROWS, flat % ROWS
        nb = self.in_features // BLOCK
        wq = self.wq[g]  # [T, nb, bytes]
        if self.kind == S8:
            codes = wq.view(-1, nb, 8, ROWS, 4)[torch.arange(len(flat)), :, :, r].view(torch.int8).float()
        else:
            packed = wq[..., :128].view(-1, nb, 4, ROWS, 4)[torch.arange(len(flat)), :, :, r]  # [T, nb, 4, 4]
            codes = torch.cat([packed & 0x0F, packed >> 4], dim=2)  # [T, nb, quad, 4]
            if self.kind == U5:
                bits = wq[..., 128:].view(-1, nb, ROWS, 4)[torch.arange(len(flat)), :, r]  # [T, nb, 4]
                shifts = torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)
                codes = codes | (((bits.unsqueeze(2) >> shifts) & 1) << 4)
            codes = codes.float()
        d = self.d[g, :, r]  # [T, nb]
        out = codes.reshape(-1, nb, BLOCK) * d.unsqueeze(-1)
        if self.mn is not None:
            out = out + self.mn[g, :, r].unsqueeze(-1)
        return out.reshape(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The whole weight decoded: [N, K] float32."""
        return self.rows(torch.arange(self.out_features))
