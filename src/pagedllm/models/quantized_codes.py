"""A quantized weight at load time, in numpy: integer codes plus one fp32 scale and offset per row and group of k's.

    w[n, k] = fma(float(codes[n, k]), scales[n, k // group], offsets[n, k // group])   (one fp32 rounding)

models/gguf_unpack.py builds it from GGUF blocks so that this value is exactly gguf's dequantized weight. Rows can be
permuted (llama.cpp's Q/K rotary order) and weights concatenated along rows (fused qkv / gate_up: parts of different
types are promoted to the smaller group and the wider codes, which changes no value). `PackedWeight.from_codes`
(layers/quantized_weight.py) lays it out for the kernels. No torch here: the API server reads GGUF metadata through
the same loader modules without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class QuantizedWeight:
    codes: np.ndarray  # [N, K] int8
    scales: np.ndarray  # [N, K / group] float32
    offsets: np.ndarray  # [N, K / group] float32
    group: int  # k's per scale: 16 or 32
    bits: int  # 4 (codes 0..15) or 8 (int8 codes)
    qtypes: tuple[str, ...]  # the GGUF types it came from, for logs and errors

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def map_rows(self, fn) -> QuantizedWeight:
        """The same weight with fn (a row permutation of an [N, ...] array) applied to its rows."""
        return QuantizedWeight(fn(self.codes), fn(self.scales), fn(self.offsets), self.group, self.bits, self.qtypes)

    def with_group(self, group: int) -> QuantizedWeight:
        """The same values with one scale per `group` k's (group divides self.group)."""
        if group == self.group:
            return self
        repeat = self.group // group
        return QuantizedWeight(self.codes, np.repeat(self.scales, repeat, axis=1),
                               np.repeat(self.offsets, repeat, axis=1), group, self.bits, self.qtypes)

    @staticmethod
    def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of each part in order (fused projections); ValueError when their K differ."""
        if len({p.shape[1] for p in parts}) != 1:
            raise ValueError(f"parts have different input sizes {[list(p.shape) for p in parts]}")
        group, bits = min(p.group for p in parts), max(p.bits for p in parts)
        parts = [p.with_group(group) for p in parts]
        qtypes = tuple(dict.fromkeys(t for p in parts for t in p.qtypes))
        return QuantizedWeight(np.concatenate([p.codes for p in parts]), np.concatenate([p.scales for p in parts]),
                               np.concatenate([p.offsets for p in parts]), group, bits, qtypes)
