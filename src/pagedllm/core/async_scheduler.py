"""AsyncScheduler (--async-scheduling): schedules step N+1 before step N's sampled tokens are known.

The engine core (engine/core.py, its batch queue of two) submits step N+1 while step N runs and applies N's outputs
while N+1 runs, so neither scheduling nor output processing sits between two model steps. Each running request
that step N samples for gets a placeholder (Request.num_output_placeholders): schedule() counts it as a token the
request already has, so the request's next decode goes into step N+1 at once. The model runner knows the token
by then (steps run in submission order and the runner appends every token it samples to its own batch), and
update_from_output swaps each placeholder for its token.

Example, a decode at 10 tokens (9 computed): step N computes position 9 (computed 10, one placeholder); step N+1
is scheduled before N's token is applied and computes position 10, whose token N samples (computed 11, two
placeholders); N's output appends token 10 (one placeholder left), and so on.

What differs from the Scheduler:
- a request whose steps in flight already take it to max_tokens or max_model_len is not scheduled again (the
  runner would write past max_model_len, and the token would be dropped anyway);
- a request that stops at step N (EOS, a stop token, a stop string, an abort) was already scheduled in N+1:
  N+1's token for it is dropped when applied (the request is gone), and its blocks were freed when it finished:
  step N+1 writes them before any later step can reuse them, as steps run in order;
- preemption clears the placeholders; the outputs of the steps in flight are then stale and dropped, as with
  pipeline parallelism (the request recomputes them);
- a constrained request's grammar mask for step N+1 depends on step N's token: while such a request has a
  placeholder the engine applies step N before it schedules again (has_pending_grammar_tokens), so batches with
  structured outputs step synchronously.
Speculative decoding and pipeline parallelism are refused with it (config/engine.py), as vLLM's V1 runner does.
"""

from __future__ import annotations

from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import SchedulerOutput


class AsyncScheduler(Scheduler):
    def schedule(self) -> SchedulerOutput:
        """Scheduler.schedule(), then a placeholder for every request the step samples for (its scheduled
        tokens reach past the tokens it has, placeholders included: a prefill chunk that does not end the
        prompt samples nothing)."""
        output = super().schedule()
        requests = self.requests
        for req_id in output.num_scheduled_tokens:
            request = requests[req_id]
            if request.num_computed_tokens >= len(request.all_token_ids) + request.num_output_placeholders:
                request.num_output_placeholders += 1
        return output

    def _reaches_limit_in_flight(self, request: Request) -> bool:
        """Whether the tokens the steps in flight will sample already take the request to max_tokens or
        max_model_len (it stops there, so a further step would be wasted)."""
        num_tokens = len(request.all_token_ids) + request.num_output_placeholders
        max_tokens = request.max_tokens
        return num_tokens >= self.max_model_len or (
            max_tokens is not None and num_tokens - request.num_prompt_tokens >= max_tokens)

    def _preempt(self, request: Request) -> None:
        super()._preempt(request)
        request.num_output_placeholders = 0  # the outputs in flight are stale now (preempted_at_step)

    def has_pending_grammar_tokens(self) -> bool:
        """Whether a running request under a grammar waits for a token from a step in flight: its next mask
        needs that token, so the engine applies that step before scheduling again."""
        return any(r.num_output_placeholders and r.structured_output_request is not None for r in self.running)
