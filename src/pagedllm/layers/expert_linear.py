"""ExpertLinear: one linear layer per expert of a mixture-of-experts block, their weights stacked as transformers
stacks them (`weight` [E, out_features, in_features]), each multiplied on its own slice of tokens
(layers/fused_moe.py groups the tokens by expert).

As layers/linear.py's Linear, per expert: on the CPU in fp32 the stacked weight is repacked once after loading into
oneDNN's blocked layout (`pack_weights`: one packed matrix per expert, so each row's result does not depend on how
many tokens the expert got, DESIGN invariant 2), or the weights are kept quantized (a GGUF model's stacked expert
tensors, `--quantization fp8`: `set_quantized_weight` with a QuantizedExperts, one quantized matrix per expert run
by the native kernels). Elsewhere (CUDA, bf16) F.linear on the expert's slice of the stacked weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.int8_activation_weight import Int8ActivationWeight
from pagedllm.layers.linear import onednn_available
from pagedllm.layers.quantized_weight import PackedWeight

RunWeight = PackedWeight | Int8ActivationWeight


@dataclass(eq=False)
class QuantizedExperts:
    """The experts' weights of one ExpertLinear kept quantized: one [N, K] quantized matrix per expert, in order."""

    weights: list[RunWeight]

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self.weights), *self.weights[0].shape)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights)

    @property
    def qtypes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t for w in self.weights for t in w.qtypes))


class ExpertLinear(nn.Module):
    """`num_experts` linears in_features -> out_features without bias; this rank's experts
    [first_expert, first_expert + num_experts) of the checkpoint's (all of them but under expert parallelism)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, first_expert: int = 0):
        super().__init__()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.first_expert = first_expert
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        self.quant_weight: QuantizedExperts | None = None  # set by set_quantized_weight
        self.packed_weights: list[torch.Tensor] | None = None  # oneDNN's layout of each expert's weight

    def set_quantized_weight(self, weight: QuantizedExperts) -> None:
        """Run on `weight` (one quantized matrix per expert, CPU fp32 activations); the float weight is dropped."""
        if weight.shape != (self.num_experts, self.out_features, self.in_features):
            raise ValueError(f"quantized experts {list(weight.shape)} for {self.num_experts} experts of "
                             f"{self.in_features} -> {self.out_features}")
        self.quant_weight = weight
        self.weight = None

    def pack_weights(self) -> None:
        """Repack each expert's weight for oneDNN where that applies (Linear.pack_weights); frees the stacked one."""
        weight = self.weight
        if weight is None or not onednn_available(weight):
            return
        self.packed_weights = [torch.ops.mkldnn._reorder_linear_weight(w.detach(), None) for w in weight]
        self.weight = None

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert `expert`'s linear: x [M, in_features] -> [M, out_features]."""
        if self.quant_weight is not None:
            return self.quant_weight.weights[expert].matmul(x)
        if self.packed_weights is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weights[expert], None, "none", [], "")
        return F.linear(x, self.weight[expert])
