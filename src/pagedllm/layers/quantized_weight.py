"""Weights kept quantized in memory and multiplied in that form on the CPU (fp32 activations).

Two forms:
- `QuantizedWeight` (models/quantized_codes.py, numpy, load time): a weight [N, K] as integer codes [N, K] int8 plus
  one fp32 scale and offset per row and group of `group` k's ([N, K / group] each); weight value
  w[n, k] = fma(code, scale, offset), one fp32 rounding, exactly gguf's dequantized weight (models/gguf_unpack.py).
- `PackedWeight` (here, torch, run time; `PackedWeight.from_codes`): the same numbers in the kernels' panel
  layout, a flat uint8 tensor:
    panels of 8 output rows (N padded to a multiple of 8 with zero rows), each panel K / group groups of
      scale[8] f32 | offset[8] f32 | codes
    bits = 4: group / 2 pairs of k, 8 bytes each: byte r = code(k, row r) | code(k + 1, row r) << 4 (codes 0..15)
    bits = 8: group k's, 8 bytes each: byte r = code(k, row r), int8
  so the 8 rows' codes of one k sit together and decode into one 8-lane vector. Kernels: kernels/quant_linear_cpu.c
  (`quant_linear_f32`: y = x @ W^T; `quant_gather_rows_f32`: decoded rows, the embedding lookup).
  Each output is one fp32 fma chain over k in order (see the C file), so a row's result does not depend on the
  batch size or the thread count, and differs from multiplying the dequantized weights only in summation order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.kernels import cpu_kernels
from pagedllm.math_utils import cdiv

if TYPE_CHECKING:
    from pagedllm.models.quantized_codes import QuantizedWeight

PANEL = 8


@dataclass(eq=False)
class PackedWeight:
    data: torch.Tensor  # uint8, flat: the panel layout above
    bits: int
    group: int
    out_features: int  # N
    in_features: int  # K
    qtypes: tuple[str, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @staticmethod
    def from_codes(weight: QuantizedWeight) -> PackedWeight:
        """Lay a load-time QuantizedWeight out in panels (the layout above)."""
        n, k = weight.shape
        num_panels, num_groups = cdiv(n, PANEL), k // weight.group
        pad = num_panels * PANEL - n

        def panels(a: np.ndarray) -> np.ndarray:  # [N, X, ...] -> [P, X, ..., 8] (rows last)
            a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
            a = a.reshape(num_panels, PANEL, *a.shape[1:])
            return np.moveaxis(a, 1, -1)

        codes = panels(weight.codes.view(np.uint8).reshape(n, num_groups, weight.group))  # [P, G, group, 8]
        if weight.bits == 4:
            codes = codes[:, :, 0::2] | (codes[:, :, 1::2] << 4)  # k pairs -> one byte per row
        scales = np.ascontiguousarray(panels(weight.scales), np.float32).view(np.uint8)  # [P, G, 32]: 8 fp32
        offsets = np.ascontiguousarray(panels(weight.offsets), np.float32).view(np.uint8)
        data = np.concatenate([scales.reshape(num_panels, num_groups, -1), offsets.reshape(num_panels, num_groups, -1),
                               codes.reshape(num_panels, num_groups, -1)], axis=2)
        return PackedWeight(torch.from_numpy(data.reshape(-1)), weight.bits, weight.group, n, k, weight.qtypes)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T: x [..., K] float32 -> [..., N] float32."""
        x2 = x.reshape(-1, self.in_features).contiguous()
        y = cpu_kernels.quant_linear(self.data, self.bits, self.group, x2, self.out_features)
        return y.reshape(*x.shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Decoded rows W[ids]: ids [...] int64 -> [..., K] float32; IndexError for an id outside [0, N)."""
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.out_features):
            raise IndexError(f"index out of range for a weight of {self.out_features} rows")
        out = cpu_kernels.quant_gather_rows(self.data, self.bits, self.group, flat.to(torch.int64), self.in_features)
        return out.reshape(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The whole weight decoded: [N, K] float32 (the values every kernel multiplies)."""
        return self.rows(torch.arange(self.out_features))
