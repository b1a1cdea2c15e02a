"""The step a Scheduler.schedule() call is building: its budgets and what it has scheduled so far."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.core.block_pool import KVCacheBlock
    from pagedllm.core.request import Request


@dataclass
class StepBuilder:
    """Scratch state of one Scheduler.schedule() call: the token and prefill-attention budgets left, and what
    has been scheduled so far (the scheduler turns it into a SchedulerOutput)."""

    token_budget: int
    attention_pairs: int | None = None
    """Prefill attention pairs left this step (None: no cap)."""
    prefill_pairs: dict[str, int] = field(default_factory=dict)
    """The pairs each prefill chunk scheduled this step took from attention_pairs."""
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_blocks: dict[str, list[KVCacheBlock]] = field(default_factory=dict)
    running_reqs: list[Request] = field(default_factory=list)
    new_reqs: list[Request] = field(default_factory=list)
    preempted_reqs: list[Request] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    """req_id -> the drafts verified this step (speculative decoding)."""
    use_spec: bool = False
    """Whether running requests' drafts are scheduled this step."""
    loras: set[int] | None = None
    """The LoRA adapters (lora_int_id) of the running requests and of those admitted this step (None: not counted
    yet)."""

    def admits_lora(self, request: Request, running: list[Request], max_loras: int | None) -> bool:
        """Whether a waiting request's adapter fits this step: it is the base model's, or an adapter already in
        the step, or one more adapter while fewer than max_loras are (vLLM's rule); counts it in if so."""
        lora = request.lora_request
        if lora is None or max_loras is None:
            return True
        if self.loras is None:
            self.loras = {r.lora_request.lora_int_id for r in running if r.lora_request is not None}
        if lora.lora_int_id in self.loras:
            return True
        if len(self.loras) >= max_loras:
            return False
        self.loras.add(lora.lora_int_id)
        return True

    def add(self, request: Request, num_tokens: int, new_blocks: list[KVCacheBlock]) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.new_blocks[request.request_id] = new_blocks
        self.token_budget -= num_tokens

    def unschedule(self, request: Request) -> int:
        """Drop a running request scheduled earlier this step (it was just preempted).

        Returns:
            The tokens it had been given, for the caller to put back in its budget.
        """
        del self.new_blocks[request.request_id]
        self.spec_tokens.pop(request.request_id, None)
        self.running_reqs.remove(request)
        if request.request_id in self.prefill_pairs:
            self.attention_pairs += self.prefill_pairs.pop(request.request_id)
        return self.num_scheduled_tokens.pop(request.request_id)

    def cap_prefill(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        """num_new_tokens cut to the largest chunk T whose T x (num_computed_tokens + T) pairs fit the attention
        budget left (a decode, one token, is not capped). The step's first prefill chunk gets at least one
        token, so a request always advances. E.g. 2,097,152 pairs left: at 0 computed tokens T = 1,448
        (1,448 x 1,448 = 2,096,704); at 7,000, T = 287 (287 x 7,287 = 2,091,369)."""
        if self.attention_pairs is None or num_new_tokens <= 1:
            return num_new_tokens
        c = num_computed_tokens
        fit = (math.isqrt(c * c + 4 * self.attention_pairs) - c) // 2  # largest T with T * (c + T) <= pairs
        if not self.prefill_pairs:
            fit = max(fit, 1)
        return min(num_new_tokens, fit)

    def count_prefill(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> None:
        """Take a scheduled prefill chunk's pairs from the attention budget (a one-token chunk too: uncounted, the
        budget's last pairs let every waiting prompt in with one token each; at most what is left)."""
        if self.attention_pairs is not None:
            pairs = min(num_new_tokens * (num_computed_tokens + num_new_tokens), self.attention_pairs)
            self.prefill_pairs[request.request_id] = pairs
            self.attention_pairs -= pairs
