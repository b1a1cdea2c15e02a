"""--scheduling-policy slo (pagedllm's extension of vLLM's flag): the waiting queue ordered by deadline slack, with
priority aging, a starvation bound, early shedding and the choice of whom to preempt.

A request may carry `ttft_slo_ms` (its first token is due that long after arrival) and `tpot_slo_ms` (each further
token that long after the one before: the n-th output token is due at arrival + TTFT + n x TPOT). The waiting
queue's order, re-evaluated as time passes (a request's rank changes while it waits):
  1. requests that waited --slo-max-wait-s or longer (since arrival), oldest first: ahead of every newer request,
     whatever its priority or slack, so nothing starves past the bound;
  2. the others by aged priority (`priority` minus one level per quarter of the bound waited), then by slack
     (deadline - now - estimated prefill time; no deadline: infinite slack, after every request with one), then
     arrival.
The prefill estimate is the request's uncomputed tokens times the engine's measured seconds per token, an EMA over
recent steps that are mostly prefill (EngineCore feeds every step; decode steps, mostly fixed overhead, would price
a prompt's tokens many times too high and shed requests that could still make it: a fit of a + b x tokens over all
steps did that on a loaded machine, where a decode step's time is noise). It errs low rather than high (a step's
fixed cost is spread over its tokens; prefix-cache hits are not known before the lookup, which makes it high there):
shedding is for requests that cannot make it. Until a prefill step has been measured there is no estimate (0 s)
and nothing is shed.

Shedding: a waiting request that has produced no token yet and whose TTFT deadline cannot be met even if it were
scheduled now (now + prefill estimate > deadline) is finished with an error (HTTP 503, code slo_unattainable)
instead of being served late; its blocks and state are freed like an abort's. A request that already streamed
tokens (preempted, back in the queue) is never shed. Running requests that fall behind their TPOT keep running:
stopping them would waste the tokens already sent; they are only the first candidates for preemption.

Preemption: the running request with the lowest aged priority, then the most slack to its next token's deadline
(no deadline: most), then the latest arrival.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from pagedllm.core.request import Request, RequestStatus
from pagedllm.messages import SLO_UNATTAINABLE, EngineCoreOutput, FinishReason

THROUGHPUT_EMA_WEIGHT = 0.1
"""Weight of the latest prefill step in the seconds-per-token estimate."""
PREFILL_TOKENS_PER_REQ = 4
"""A step counts for the prefill estimate when it computes at least this many tokens per request."""
AGING_LEVELS = 4
"""A waiting request's priority improves by one level per 1/AGING_LEVELS of --slo-max-wait-s waited."""
_SHEDDABLE = (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.WAITING_FOR_FSM)


class SLORequestQueue:
    """The waiting queue of --scheduling-policy slo, with the request-queue interface of core/request_queue.py.

    Args:
        max_wait_s: SchedulerConfig.slo_max_wait_s, the starvation bound.
        clock: wall time in seconds, the clock of Request.arrival_time (tests pass a simulated one).
    """

    def __init__(self, max_wait_s: float, clock: Callable[[], float] = time.time):
        self.max_wait_s = max_wait_s
        self.clock = clock
        self._seconds_per_token: float | None = None
        """EMA over recent prefill steps of their seconds per token (None: none measured yet)."""
        self._requests: list[Request] = []
        self._ordered_at: float | None = None  # when _requests was last sorted (None: not in order)

    # ---- the measure the estimates use ----

    def observe_step(self, num_tokens: int, seconds: float, num_reqs: int = 1) -> None:
        """A step computed num_tokens tokens of num_reqs requests in `seconds` (EngineCore's measure). Only steps
        that are mostly prefill (at least PREFILL_TOKENS_PER_REQ tokens a request) count: a decode step's time is
        mostly fixed overhead, and would price a prompt's tokens many times too high."""
        if num_tokens < PREFILL_TOKENS_PER_REQ * max(num_reqs, 1) or seconds <= 0:
            return
        sample = seconds / num_tokens
        w = THROUGHPUT_EMA_WEIGHT
        self._seconds_per_token = sample if self._seconds_per_token is None else (
            (1 - w) * self._seconds_per_token + w * sample)
        self._ordered_at = None  # the slacks changed

    @property
    def tokens_per_s(self) -> float | None:
        """The engine's measured prefill throughput; None before a prefill step."""
        return None if self._seconds_per_token is None else 1 / self._seconds_per_token

    def prefill_estimate_s(self, request: Request) -> float:
        """Seconds to compute the request's tokens not yet computed (0 without a measure)."""
        if self._seconds_per_token is None:
            return 0.0
        return self._seconds_per_token * max(request.num_tokens - request.num_computed_tokens, 0)

    @staticmethod
    def deadline(request: Request) -> float | None:
        """When its next token is due (wall time); None: no deadline."""
        params = request.sampling_params
        if params.ttft_slo_ms is None:
            return None
        due = request.arrival_time + params.ttft_slo_ms / 1000
        if request.num_output_tokens and params.tpot_slo_ms is not None:
            due += request.num_output_tokens * params.tpot_slo_ms / 1000
        return due

    def _aged_priority(self, request: Request, waited: float) -> int:
        return request.priority - int(waited * AGING_LEVELS / self.max_wait_s)

    def _key(self, request: Request, now: float) -> tuple:
        waited = now - request.arrival_time
        if waited >= self.max_wait_s:
            return (0, 0, 0.0, request.arrival_time)
        due = self.deadline(request)
        slack = math.inf if due is None else due - now - self.prefill_estimate_s(request)
        return (1, self._aged_priority(request, waited), slack, request.arrival_time)

    # ---- the request-queue interface ----

    def _ordered(self) -> list[Request]:
        now = self.clock()
        if self._ordered_at != now:  # ranks change as time passes: sort again (once per clock reading)
            self._requests.sort(key=lambda r: self._key(r, now))
            self._ordered_at = now
        return self._requests

    def add(self, request: Request) -> None:
        self._requests.append(request)
        self._ordered_at = None

    prepend = add  # a preempted request keeps its arrival (and so its age): it re-enters at its rank

    def peek(self) -> Request:
        return self._ordered()[0]

    def pop(self) -> Request:
        """The request peek() returned (the order is not re-evaluated between the two: the scheduler admits what
        it peeked, and the clock may have moved a rank meanwhile)."""
        if self._ordered_at is None:
            self._ordered()
        return self._requests.pop(0)

    def remove(self, request: Request) -> None:
        for i, r in enumerate(self._requests):
            if r is request:
                del self._requests[i]
                return
        raise ValueError(f"request {request.request_id!r} is not waiting.")

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._ordered()))

    # ---- shedding and preemption ----

    def unattainable(self) -> list[tuple[Request, str]]:
        """Waiting requests that cannot meet their TTFT deadline even if scheduled now, each with the reason."""
        if self._seconds_per_token is None:
            return []
        now = self.clock()
        shed = []
        for request in self._requests:
            ttft = request.sampling_params.ttft_slo_ms
            if ttft is None or request.num_output_tokens or request.status not in _SHEDDABLE:
                continue
            estimate = self.prefill_estimate_s(request)
            waited = now - request.arrival_time
            if waited + estimate > ttft / 1000:
                shed.append((request, (
                    f"The request cannot meet its ttft_slo_ms of {ttft:g} ms, so it was not run: it waited "
                    f"{waited * 1000:.0f} ms and its prefill is estimated at {estimate * 1000:.0f} ms "
                    f"({request.num_tokens} tokens at the engine's measured {self.tokens_per_s:.0f} tokens/s). "
                    "The server is overloaded; retry later or with a looser deadline.")))
        return shed

    def select_victim(self, running: list[Request]) -> int:
        """Index in `running` of the request to preempt (the module docstring's order; ties: the later)."""
        now = self.clock()

        def key(r: Request) -> tuple:
            due = self.deadline(r)
            slack = math.inf if due is None else due - now
            return (self._aged_priority(r, now - r.arrival_time), slack, r.arrival_time)

        best, best_key = 0, key(running[0])
        for index in range(1, len(running)):
            k = key(running[index])
            if k >= best_key:
                best, best_key = index, k
        return best


def shed_unattainable(scheduler: Any) -> None:
    """Finish (freeing everything) each waiting request that can no longer meet its TTFT deadline; their error
    outputs go to scheduler.shed_outputs, which EngineCore.step sends. `scheduler`: core/scheduler.py's Scheduler
    (not imported: it imports this module)."""
    queue = scheduler.waiting
    for request, reason in queue.unattainable():
        scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)
        scheduler.shed_outputs.append(EngineCoreOutput(
            request_id=request.request_id, new_token_ids=[], finish_reason=FinishReason.ERROR, error=reason,
            error_code=SLO_UNATTAINABLE))
        scheduler.num_slo_shed += 1
