"""`--quantization fp8` for Hugging Face checkpoints: each linear layer's weight is quantized at load to fp8 e4m3
with one fp32 scale per output row (vLLM's per-channel scheme: scale = amax / 448), kept in memory as 8-bit codes
(a QuantizedWeight whose `bits` is FP8_BITS) and multiplied by the quantized-weight kernels with float32
activations (W8A32: kernels/quant_linear_cpu.c decodes the fp8 codes in registers and accumulates in fp32).

Each weight becomes e4m3(w / scale) * scale: 3 mantissa bits, a relative error up to 2^-4 per weight. The
embedding and an untied LM head stay in float, as in vLLM.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.models.quantized_codes import QuantizedWeight

FP8_BITS = 9  # the `bits` value naming fp8 e4m3 codes in the packed layout (quant_linear_cpu.c's FP8)
FP8_MAX = 448.0  # the largest finite e4m3 value
GROUP = 32  # k's per stored scale: the per-row scale is repeated over the packed layout's groups
CODE_SCALE = 256.0  # the kernel decodes a code to its value / 2^8, so the stored scale is scale * 2^8 (exact)


def quantizes_to_fp8(name: str, tensor: torch.Tensor) -> bool:
    """Whether a checkpoint tensor is a linear layer's weight (what fp8 quantization applies to)."""
    return name.endswith("_proj.weight") and tensor.dim() == 2


def quantize_fp8(weight: torch.Tensor, name: str) -> QuantizedWeight:
    """[N, K] float weight -> fp8 e4m3 codes and per-row scales; ValueError when K is not a multiple of 32."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"--quantization fp8: {name} has {k} input features, not a multiple of {GROUP}")
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [N]; an all-zero row keeps codes 0
    codes = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.int8).numpy()
    stored = np.repeat((scale * CODE_SCALE).numpy()[:, None], k // GROUP, axis=1)
    return QuantizedWeight(codes=codes, scales=stored, offsets=np.zeros_like(stored), group=GROUP, bits=FP8_BITS,
                           qtypes=("fp8_e4m3",))


def fp8_reference(weight: torch.Tensor) -> torch.Tensor:
    """The float32 values fp8 quantization gives a weight: e4m3(w / scale) * scale (tests, drift measurements)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
