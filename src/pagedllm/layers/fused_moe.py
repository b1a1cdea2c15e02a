"""A sparse mixture-of-experts MLP (Mixtral's block_sparse_moe, Qwen3-MoE's sparse MLP), vLLM's FusedMoE on torch ops:

1. route: the router `gate` (a Linear hidden -> E, kept in float) gives each token E logits; their softmax (in
   float32, as transformers), the top-k experts by probability, the k weights renormalised to sum 1 where the
   family says so (Mixtral always, which is the softmax over the top-k logits; Qwen3-MoE where norm_topk_prob);
2. group: the T * k (token, expert) slots sorted by expert id (a stable argsort), so each expert's tokens are one
   contiguous slice of the gathered inputs;
3. one SwiGLU per expert over its slice (ExpertLinear: gate_up_proj, silu(gate) * up, down_proj), no loop over
   tokens; each output row times its routing weight, added back to its token with index_add (a token's experts
   in expert-id order, as transformers adds them).

With tensor parallelism each rank holds every expert's share of the intermediate size (gate_up_proj rows, down_proj
columns: models/tensor_parallel_weights.py), and one all-reduce sums the ranks' partial outputs, as LlamaMLP's.
With expert parallelism too (--enable-expert-parallel: TensorParallelGroup.expert_parallel) rank r of n holds experts
[r * E / n, (r + 1) * E / n) whole (models/expert_weights.py's local_experts): every rank routes the same tokens (the
group's ranks run the same batch), runs its experts on the slots routed to them, and the same all-reduce sums the
ranks' partial outputs: no dispatch is needed, as each token is already on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.expert_linear import ExpertLinear
from pagedllm.layers.linear import Linear


@dataclass(frozen=True)
class MoEOptions:
    """One layer's mixture of experts (a family's `moe_options`; None there: a dense MLP layer)."""

    num_experts: int
    top_k: int  # experts per token (num_experts_per_tok)
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k weights divided by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), each token's experts by
    decreasing probability."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Experts(nn.Module):
    """The experts' SwiGLU weights, stacked: gate_up_proj [E, 2 * I, hidden] (gate rows first, then up),
    down_proj [E, hidden, I]; I is this rank's share of the intermediate size."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, first_expert: int = 0):
        super().__init__()
        self.num_experts, self.first_expert = num_experts, first_expert
        self.gate_up_proj = ExpertLinear(num_experts, hidden_size, 2 * intermediate_size, first_expert)
        self.down_proj = ExpertLinear(num_experts, intermediate_size, hidden_size, first_expert)
        self.act_fn = SiluAndMul()

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        # x: [M, hidden], the tokens routed to local expert `expert` -> [M, hidden]
        return self.down_proj(expert, self.act_fn(self.gate_up_proj(expert, x)))


class FusedMoE(nn.Module):
    routed_tokens: torch.Tensor | None = None
    """[E] int64 that each forward adds its tokens per expert to (set by `routed_token_counter`), else None."""

    def __init__(self, hidden_size: int, options: MoEOptions, tp: TensorParallelGroup):
        super().__init__()
        self.tp = tp
        self.num_experts, self.top_k, self.renormalize = options.num_experts, options.top_k, options.renormalize
        self.gate = Linear(hidden_size, options.num_experts, bias=False)
        if tp.expert_parallel:
            if options.num_experts % tp.size:
                raise ValueError(f"--enable-expert-parallel: --tensor-parallel-size {tp.size} does not divide the "
                                 f"model's {options.num_experts} experts.")
            first, end = tp.split(options.num_experts)
            self.experts = Experts(end - first, hidden_size, options.intermediate_size, first)
        else:
            if options.intermediate_size % tp.size:
                raise ValueError(f"--tensor-parallel-size {tp.size} does not divide the experts' intermediate size "
                                 f"{options.intermediate_size} (--enable-expert-parallel splits the experts "
                                 "instead).")
            self.experts = Experts(options.num_experts, hidden_size, options.intermediate_size // tp.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)  # [T, k] each
        flat = ids.reshape(-1)  # [T * k]: slot s is token s // k's (s % k)-th expert
        order = flat.argsort(stable=True)  # slots by expert id; ties keep token order
        counts = torch.bincount(flat, minlength=self.num_experts)  # [E] tokens routed to each expert
        if self.routed_tokens is not None:
            self.routed_tokens += counts
        first, n = self.experts.first_expert, self.experts.num_experts
        start = int(counts[:first].sum())  # this rank's experts' slots are order[start:end]
        sizes = counts[first:first + n].tolist()
        slots = order[start:start + sum(sizes)]
        tokens = slots // self.top_k  # [S] the token of each slot, grouped by expert
        grouped = x.index_select(0, tokens)  # [S, hidden]
        outputs = []
        offset = 0
        for expert, size in enumerate(sizes):  # one matmul chain per expert over its tokens
            if size:
                outputs.append(self.experts(expert, grouped[offset:offset + size]))
                offset += size
        y = torch.zeros_like(x)
        if outputs:
            out = torch.cat(outputs) if len(outputs) > 1 else outputs[0]  # [S, hidden]
            out.mul_(weights.reshape(-1).index_select(0, slots).unsqueeze(1).to(out.dtype))
            y.index_add_(0, tokens, out)
        return self.tp.all_reduce(y)


def routed_token_counter(model: nn.Module, device: torch.device) -> torch.Tensor | None:
    """One [E] int64 counter on `device` (the model's) that every FusedMoE of `model` adds the tokens it routes to
    each expert to (the model runner zeroes it before a step and reads it after: the routed-token balance in
    /metrics); None for a model without experts, or whose layers have different numbers of experts."""
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    if not layers or len({m.num_experts for m in layers}) != 1:
        return None
    counter = torch.zeros(layers[0].num_experts, dtype=torch.int64, device=device)
    for m in layers:
        m.routed_tokens = counter
    return counter
