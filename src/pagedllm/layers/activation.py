"""SwiGLU's gate: silu(gate) * up over a fused [gate | up] projection (one native pass on the CPU in fp32,
kernels/elementwise_cpu.c; torch ops elsewhere); GeGLU's (Gemma 2): gelu_tanh(gate) * up, torch ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu_kernels


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, 2 * intermediate] -> [T, intermediate]
        if x.dtype == torch.float32 and x.is_contiguous() and cpu_kernels.available(x.dtype, x.device):
            return cpu_kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu(gate, approximate="tanh") * up (transformers' gelu_pytorch_tanh): Gemma 2's MLP."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, 2 * intermediate] -> [T, intermediate]
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
