"""A seeded discrete-event simulation of replicas with continuous batching, to check `pagedllm plan`.

Requests arrive as a Poisson process at lambda (or, in closed-loop mode, `concurrency` clients each send the
next request as the last one ends: how `bench serve --max-concurrency` measures). A round-robin router deals
them to the replicas. Each replica runs engine steps back to back while it has work: at a step's start it admits
waiting requests (first come, first served) up to --max-num-seqs; the step takes the step model's decode time
for the running batch plus a prefill cost per newly admitted request; at its end every admitted request has its
first token (TTFT = end - arrival) and every other running one its next token (ITL = end - its last token).
A request leaves after its output length of tokens. Pure Python; `random.Random(seed)`. Every request waiting
at a step's start is admitted (up to the free slots), so arrivals bunched by Poisson traffic, or released together
by a queue as slots free, are prefilled in one step: the bursts that set the p99 ITL. The planner models them
analytically (bench/plan_itl.py); this simulation, another code path, checks that model.

Step models: `LinearStepModel` (decode = base + per_seq x batch, fixed prefill: a synthetic machine for tests)
and `CurveStepModel` (decode = the measured mean ITL at the batch, prefill = measured mean TTFT - ITL at the
smallest batch: the measured machine, for `pagedllm plan --simulate`).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from pagedllm.bench.plan_curve import Curve


class StepModel(Protocol):
    def decode_s(self, batch: int) -> float: ...

    def prefill_s(self, prompt_len: int) -> float: ...


@dataclass(frozen=True)
class LinearStepModel:
    base_s: float
    per_seq_s: float
    prefill_per_token_s: float

    def decode_s(self, batch: int) -> float:
        return self.base_s + self.per_seq_s * batch

    def prefill_s(self, prompt_len: int) -> float:
        return self.prefill_per_token_s * prompt_len


class CurveStepModel:
    """Step times read off a measured Curve (batches above the largest measured one: extrapolated linearly)."""

    def __init__(self, curve: Curve):
        self.curve = curve
        cs = curve.concurrencies
        vs = curve.values["mean_itl_ms"]
        self._slope = (vs[-1] - vs[-2]) / (cs[-1] - cs[-2]) / 1000 if len(cs) > 1 else 0.0

    def decode_s(self, batch: int) -> float:
        top = self.curve.max_batch
        if batch <= top:
            return self.curve.at("mean_itl_ms", batch) / 1000
        return self.curve.at("mean_itl_ms", top) / 1000 + self._slope * (batch - top)

    def prefill_s(self, prompt_len: int) -> float:
        return self.curve.prefill_ms(prompt_len) / 1000


@dataclass
class _Req:
    arrival: float
    prompt_len: int
    output_len: int
    done: int = 0
    last: float = 0.0
    ttft: float | None = None


def _lengths(rng: random.Random, mean: int, ratio: float) -> int:
    if ratio <= 0:
        return mean
    return max(1, rng.randint(math.floor(mean * (1 - ratio)), math.ceil(mean * (1 + ratio))))


def simulate(model: StepModel, *, replicas: int, max_num_seqs: int, prompt_len: int, output_len: int,
             arrival_rate: float | None = None, concurrency: int | None = None, num_requests: int = 2000,
             len_range_ratio: float = 0.0, seed: int = 0) -> dict[str, Any]:
    """Run `num_requests` through the replicas; p50/p99 TTFT and ITL (ms), utilisation, throughput.

    Give `arrival_rate` (open loop, Poisson) or `concurrency` (closed loop). Requests still queued when the
    last arrival has been served count with their TTFT as measured at the end (unstable loads show it).
    """
    if (arrival_rate is None) == (concurrency is None):
        raise ValueError("give exactly one of arrival_rate and concurrency")
    rng = random.Random(seed)
    reqs: list[_Req] = []

    def new(t: float) -> _Req:
        r = _Req(t, _lengths(rng, prompt_len, len_range_ratio), _lengths(rng, output_len, len_range_ratio))
        reqs.append(r)
        return r

    # events: (time, seq, kind, replica); kinds: "arrive" (a request to route), "step" (a replica's step ends)
    events: list[tuple[float, int, str, int]] = []
    seq = 0
    waiting = [deque() for _ in range(replicas)]
    running: list[list[_Req]] = [[] for _ in range(replicas)]
    busy_until = [0.0] * replicas
    stepping = [False] * replicas
    busy_time = [0.0] * replicas
    batch_sum = [0.0] * replicas
    pending_arrivals: deque[_Req] = deque()
    next_replica = 0
    ttfts: list[float] = []
    itls: list[float] = []
    finished = 0

    def push(t: float, kind: str, replica: int = -1) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, replica))

    def start_step(i: int, t: float) -> None:
        new_admits = []
        while waiting[i] and len(running[i]) < max_num_seqs:
            r = waiting[i].popleft()
            running[i].append(r)
            new_admits.append(r)
        if not running[i]:
            stepping[i] = False
            return
        dur = model.decode_s(len(running[i])) + sum(model.prefill_s(r.prompt_len) for r in new_admits)
        stepping[i] = True
        busy_time[i] += dur
        batch_sum[i] += dur * len(running[i])
        busy_until[i] = t + dur
        push(t + dur, "step", i)

    def route(r: _Req, t: float) -> None:
        nonlocal next_replica
        i = next_replica
        next_replica = (next_replica + 1) % replicas
        waiting[i].append(r)
        if not stepping[i]:
            start_step(i, t)

    if arrival_rate is not None:
        t = 0.0
        for _ in range(num_requests):
            t += rng.expovariate(arrival_rate)
            pending_arrivals.append(new(t))
            push(t, "arrive")
    else:
        for _ in range(min(concurrency, num_requests)):
            route(new(0.0), 0.0)
    issued = len(reqs)
    end = 0.0
    while events:
        t, _, kind, i = heapq.heappop(events)
        end = t
        if kind == "arrive":
            route(pending_arrivals.popleft(), t)
            continue
        still = []
        for r in running[i]:
            r.done += 1
            if r.ttft is None:
                r.ttft = t - r.arrival
                ttfts.append(r.ttft)
            else:
                itls.append(t - r.last)
            r.last = t
            if r.done >= r.output_len:
                finished += 1
                if concurrency is not None and issued < num_requests:
                    issued += 1
                    route(new(t), t)
            else:
                still.append(r)
        running[i] = still
        start_step(i, t)
    ttfts += [end - r.arrival for r in reqs if r.ttft is None]
    return {
        "replicas": replicas, "max_num_seqs": max_num_seqs, "requests": len(reqs), "finished": finished,
        "duration_s": end, "request_throughput": finished / end if end else 0.0,
        "p50_ttft_ms": 1000 * _percentile(ttfts, 50), "p99_ttft_ms": 1000 * _percentile(ttfts, 99),
        "mean_ttft_ms": 1000 * sum(ttfts) / max(len(ttfts), 1),
        "p50_itl_ms": 1000 * _percentile(itls, 50), "p99_itl_ms": 1000 * _percentile(itls, 99),
        "mean_itl_ms": 1000 * sum(itls) / max(len(itls), 1),
        "utilisation": sum(busy_time) / (replicas * end) if end else 0.0,
        "mean_batch": sum(batch_sum) / max(sum(busy_time), 1e-12),
        "slot_utilisation": sum(batch_sum) / (replicas * max_num_seqs * end) if end else 0.0,
    }


def _percentile(values: list[float], p: float) -> float:
    """numpy's default (linear) percentile, without numpy."""
    if not values:
        return 0.0
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def as_bench_result(sim: dict[str, Any], concurrency: int, prompt_len: int, output_len: int) -> dict[str, Any]:
    """A closed-loop simulation as the `bench serve --save-result` keys the planner reads."""
    n = sim["finished"]
    return {"max_concurrency": concurrency, "completed": n, "request_throughput": sim["request_throughput"],
            "output_throughput": sim["request_throughput"] * output_len, "total_input_tokens": n * prompt_len,
            "total_output_tokens": n * output_len,
            **{k: sim[k] for k in ("mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms")}}


def meets(sim: dict[str, Any], ttft_slo_ms: float, itl_slo_ms: float) -> bool:
    return sim["p99_ttft_ms"] <= ttft_slo_ms and sim["p99_itl_ms"] <= itl_slo_ms
