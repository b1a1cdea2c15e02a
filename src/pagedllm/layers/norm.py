"""RMSNorm, computed as transformers' LlamaRMSNorm does (float32 statistics, weight in model dtype), optionally
fused with the residual add before it (vLLM's fused_add_rms_norm).

On the CPU in fp32 both run the native kernels (kernels/elementwise_cpu.c), one pass per row; elsewhere
(CUDA, bf16, kernels off) the torch ops below.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels import cpu_kernels


def _native(*tensors: torch.Tensor) -> bool:
    """fp32 contiguous tensors on a device with the kernels (checked per call: tests switch them off)."""
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_contiguous():
            return False
    return cpu_kernels.available(tensors[0].dtype, tensors[0].device)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> rms_norm(x) [T, hidden].

        With `residual` [T, hidden]: (rms_norm(x + residual), x + residual), the new residual stream. The native
        path computes both in place, in x's and residual's storage: callers must not use either afterwards
        except through the returned tensors."""
        weight = self.weight  # one nn.Module attribute lookup (~1 us): this runs 61 times per step for SmolLM2
        if residual is None:
            if _native(x, weight):
                return cpu_kernels.rms_norm(x, weight, self.eps)
            return self._norm(x)
        if _native(x, residual, weight) and x.shape == residual.shape:
            cpu_kernels.fused_add_rms_norm(x, residual, weight, self.eps)
            return x, residual
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
