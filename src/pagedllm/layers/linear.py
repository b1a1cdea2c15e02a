"""Linear layer: nn.Linear, except that a CPU fp32 batch of 2 to `SMALL_M_MAX_ROWS` rows (decode at low
concurrency) runs the native kernel that reads the weights once for all rows (kernels/linear_cpu.c)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu_kernels


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features]
        if 2 <= x.shape[0] <= cpu_kernels.SMALL_M_MAX_ROWS:  # one row: BLAS gemv is as fast
            y = cpu_kernels.linear_small_m(x, self.weight)
            if y is not None:
                return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)
