"""Linear layer: nn.Linear whose weight, on the CPU in fp32, is either kept quantized (a GGUF model's weights, set
by the loader with `set_quantized_weight`; layers/quantized_weight.py) or repacked once after loading into oneDNN's
blocked layout (`pack_weights`), then multiplied by oneDNN's matmul.

Why oneDNN and not MKL's sgemm (what F.linear calls): packing W once at load instead of on every call,
measured on the 2-core EPYC (SmolLM2 shapes, 2 threads) per layer: 2.16 -> 1.52 ms at 16 rows, 4.52 -> 3.59
at 64, 7.69 -> 7.10 at 128, equal at 2048; the 49152-row LM head at 128 rows 89 -> 55 ms. And each output row
is bitwise the same whatever the number of rows or threads (tests/layers/test_linear.py), which keeps a
request's tokens independent of its batch (DESIGN invariant 2); MKL chooses kernels by shape.
The packed copy replaces the weight (no second copy in memory), except where the weight is shared (an LM head
tied to the embedding keeps the embedding table).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.quantized_weight import PackedWeight


def onednn_available(weight: torch.Tensor) -> bool:
    """Whether `weight` can be packed for oneDNN's matmul (CPU, fp32, torch built with oneDNN)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


class Linear(nn.Linear):
    packed_weight: torch.Tensor | None = None  # oneDNN's layout of weight, set by pack_weights
    quant_weight: PackedWeight | None = None  # the weight kept quantized, set by set_quantized_weight
    lora = None  # lora/layers.py's LinearLoRA when LoRA adapters may run on this Linear (--enable-lora)

    def set_quantized_weight(self, weight: PackedWeight) -> None:
        """Run on `weight` (quantized, CPU fp32 activations) instead of a float weight, which is dropped."""
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight {list(weight.shape)} for a {self.in_features} -> {self.out_features} "
                             "Linear")
        self.quant_weight = weight
        self.weight = None

    def pack_weights(self) -> None:
        """Repack the loaded weight for oneDNN where that applies; frees the plain weight unless it is shared
        with another module (tied embeddings)."""
        weight = self.weight
        if weight is None or not onednn_available(weight):
            return
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.weight = None  # a tied weight stays alive through the module that shares it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features]
        if self.quant_weight is not None:
            y = self.quant_weight.matmul(x)
            y = y if self.bias is None else y.add_(self.bias)
        elif self.packed_weight is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora.apply(x, y)


def pack_linear_weights(model: nn.Module) -> None:
    """`pack_weights` on every Linear of a loaded model and every module that repacks its weights alike (a
    mixture-of-experts block's ExpertLinear, layers/expert_linear.py)."""
    for module in model.modules():
        pack = getattr(module, "pack_weights", None)
        if callable(pack):
            pack()
