"""LoRA on a base Linear: `LinearLoRA`, attached as `linear.lora`, adds each adapter's low-rank product to the rows
of this step that run with it; the base model's rows get nothing.

The step's `LoRAMapping` (built by lora/manager.py, reached through the forward context) lists, for each adapter in
the step, the rows of the flattened batch that run with it: one contiguous slice when its requests sit together,
else an index tensor. So one forward pass serves the base model and every adapter at once, grouped by adapter:
    y = x @ W^T (the base Linear, quantized or not) ;  y[rows_g] += (x[rows_g] @ A_g^T) @ B_g^T   for each adapter g
A fused Linear (qkv_proj, gate_up_proj) holds its parts' A stacked and B block-diagonal ([out, sum of ranks], zero
outside each part's output columns), one product pair per adapter whatever the parts. The products run through the
same Linear (oneDNN-packed in fp32 on the CPU), so a row's result does not depend on the rows beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.layers.forward_context import get_forward_context
from pagedllm.layers.linear import Linear


@dataclass
class LoRAMapping:
    """This step's adapters and their rows: (lora_int_id, rows), rows a slice or an int64 index tensor."""

    groups: list[tuple[int, slice | torch.Tensor]]


class LinearLoRA:
    """The adapters of one base Linear. `parts`: module name -> (first output column, columns) it covers in the
    Linear's output (e.g. qkv_proj: q_proj, k_proj, v_proj and qkv_proj itself)."""

    def __init__(self, base: Linear, parts: dict[str, tuple[int, int]]):
        self.in_features, self.out_features = base.in_features, base.out_features
        self.parts = parts
        self.adapters: dict[int, tuple[Linear, Linear]] = {}
        """lora_int_id -> (A as a Linear in -> R, B as a Linear R -> out, scaling folded into B)."""

    def set_adapter(self, lora_id: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
                    dtype: torch.dtype) -> None:
        """Install an adapter's parts on this Linear: module name -> (A [r, in], B [part columns, r], scaling)."""
        ranks = [a.shape[0] for a, _, _ in weights.values()]
        a_all = torch.cat([a for a, _, _ in weights.values()]).to(dtype)  # [R, in]
        b_all = torch.zeros(self.out_features, sum(ranks), dtype=torch.float32)  # [out, R]
        first = 0
        for (name, (_, b, scaling)), rank in zip(weights.items(), ranks, strict=True):
            start, size = self.parts[name]
            b_all[start:start + size, first:first + rank] = b * scaling
            first += rank
        self.adapters[lora_id] = (_linear(a_all), _linear(b_all.to(dtype)))

    def remove_adapter(self, lora_id: int) -> None:
        self.adapters.pop(lora_id, None)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base output, [T, out]) with each adapter's product added to its rows of x ([T, in])."""
        mapping = get_forward_context().lora_mapping
        if mapping is None:
            return y
        for lora_id, rows in mapping.groups:
            pair = self.adapters.get(lora_id)
            if pair is None:  # the adapter does not target this module
                continue
            a, b = pair
            xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
            delta = b(a(xs.to(a_dtype(a)))).to(y.dtype)
            if isinstance(rows, slice):
                y[rows] += delta
            else:
                y.index_add_(0, rows, delta)
        return y


def a_dtype(linear: Linear) -> torch.dtype:
    weight = linear.weight if linear.weight is not None else linear.packed_weight
    return weight.dtype


def _linear(weight: torch.Tensor) -> Linear:
    """A bias-free Linear holding `weight` [out, in], packed for oneDNN where that applies (layers/linear.py)."""
    linear = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
    linear.pack_weights()
    return linear
