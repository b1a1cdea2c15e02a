"""`pagedllm plan`: replicas, KV memory and --max-num-seqs for a workload, from measured `bench serve` results.

Method (printed by the command too):

1. Arrival rate: lambda = users x requests per user per minute / 60 (requests per second).
2. The measured curve (bench/plan_curve.py): p99 and mean TTFT and ITL against batch size, from `bench serve`
   results at several --max-concurrency values (one file is accepted: its figures stand for every smaller batch).
3. ITL SLO bound: the largest batch whose p99 ITL meets the ITL SLO (and whose p99 TTFT, before any queueing,
   meets the TTFT SLO), never above the largest measured concurrency. The p99 ITL is the measured one or, if
   more, the p99 under Poisson arrivals at a replica's rate lambda / replicas (bench/plan_itl.py): mean ITL +
   k99 prefills, k99 the 99th percentile of the prefills joining a step (a Markov chain: Poisson arrivals over
   the previous step, whose length grows with its own prefills); one prefill = mean TTFT - mean ITL at the
   smallest batch. So the ITL bound depends on the replicas: fewer replicas, more prefills per step.
4. Memory bound: KV per sequence = (prompt + output, at the longest the length distribution allows) rounded up
   to whole blocks x KV bytes per token; the sequences that fit in the KV memory a replica has.
5. --max-num-seqs m = the smaller of the two; --kv-cache-memory-bytes = m x KV per sequence.
6. Service time of one request at batch b: S(b) = mean TTFT(b) + (output_len - 1) x mean ITL(b).
7. Replicas: the fewest R (from 1 up) for which, at lambda / R per replica, steps 3-5 give a batch m, a full
   replica keeps up (throughput bound: m / S(m) > lambda / R) and the queueing bound (8) holds.
8. Queueing (TTFT) bound: each replica, fed lambda / replicas by a round-robin router, is a birth-death queue
   whose completion rate with n requests is min(n, m) / S(min(n, m)) (Poisson arrivals, exponential service);
   it gives the chance a request waits for a slot and the p99 of that wait, which Allen and Cunneen's factor
   (1 + CV^2) / 2 corrects to the service times' spread (CV^2 from --len-range-ratio; 0 for fixed lengths);
   it holds when the measured p99 TTFT(m) + the p99 wait <= the TTFT SLO. The model errs towards one replica
   more (`--simulate` shows by how much); the throughput bound is the sharp one.
9. Little's law: the concurrent requests L = lambda x S(b), with b = L / replicas solved by fixed point; its
   headroom is the share of the replicas x m slots left free.

SLOs are p99 (TTFT and ITL), compared with the p99 figures of the bench results.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from pagedllm.bench.plan_curve import Curve, PlanError

METHOD = __doc__.split("Method (printed by the command too):", 1)[1].split("SLOs are", 1)[0].strip("\n")
_P = 0.99  # the SLO percentile


@dataclass(frozen=True)
class Workload:
    users: float
    requests_per_user_per_minute: float
    prompt_len: int
    output_len: int
    ttft_slo_ms: float  # p99
    itl_slo_ms: float  # p99
    len_range_ratio: float = 0.0  # lengths uniform in [mean x (1 - r), mean x (1 + r)], as bench's --random-range-ratio

    @property
    def arrival_rate(self) -> float:
        """lambda, requests per second."""
        return self.users * self.requests_per_user_per_minute / 60.0

    def validate(self) -> None:
        checks = [(self.users > 0, "--users must be positive"),
                  (self.requests_per_user_per_minute > 0, "--requests-per-user-per-minute must be positive"),
                  (self.prompt_len >= 1, "--prompt-len must be at least 1"),
                  (self.output_len >= 1, "--output-len must be at least 1"),
                  (self.ttft_slo_ms > 0, "--ttft-slo-ms must be positive"),
                  (self.itl_slo_ms > 0, "--itl-slo-ms must be positive"),
                  (0 <= self.len_range_ratio < 1, "--len-range-ratio must be in [0, 1)")]
        for ok, message in checks:
            if not ok:
                raise PlanError(message + ".")


@dataclass(frozen=True)
class Memory:
    kv_bytes_per_token: int
    kv_memory_per_replica: int  # bytes a replica can give its KV cache
    block_size: int = 16
    max_model_len: int | None = None  # the server's --max-model-len: its KV cache must hold one such sequence


@dataclass
class Plan:
    replicas: int
    max_num_seqs: int
    kv_cache_memory_bytes: int
    num_blocks: int
    binding: dict[str, str]  # which bound set each knob
    bounds: dict[str, dict[str, Any]]  # per bound: its figures and headroom
    reasoning: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def wait_probability(arrival_rate: float, service_s: Callable[[int], float], slots: int) -> float:
    """The chance an arrival finds all `slots` busy, in the birth-death chain whose completion rate with n requests
    in the replica is min(n, slots) / S(min(n, slots)): a batch serves faster per request when smaller (1.0 when
    the full batch cannot keep up)."""
    full_rate = slots / service_s(slots)
    if arrival_rate >= full_rate:
        return 1.0
    weights = [1.0]
    for n in range(1, slots + 1):
        weights.append(weights[-1] * arrival_rate / (n / service_s(n)))
    queued = weights[-1] / (1 - arrival_rate / full_rate)  # n >= slots: geometric, ratio lambda / full rate
    return queued / (sum(weights[:-1]) + queued)


def p99_wait_s(arrival_rate: float, service_s: Callable[[int], float], slots: int, service_cv2: float = 1.0) -> float:
    """p99 of the time an arrival waits for a slot: with all slots busy the queue drains as an M/M/1 at the full
    batch's rate, so the wait is exponential at rate (full rate - lambda) with probability wait_probability;
    then scaled by (1 + service_cv2) / 2, Allen and Cunneen's correction from exponential service times to those
    whose squared coefficient of variation is service_cv2 (0: every request the same length)."""
    full_rate = slots / service_s(slots)
    if arrival_rate >= full_rate:
        return math.inf
    p_wait = wait_probability(arrival_rate, service_s, slots)
    if p_wait <= 1 - _P:
        return 0.0
    return math.log(p_wait / (1 - _P)) / (full_rate - arrival_rate) * (1 + service_cv2) / 2


def service_cv2(workload: Workload, curve: Curve, batch: int) -> float:
    """Squared coefficient of variation of the service time at `batch`: output lengths uniform within
    mean x (1 +- len_range_ratio) spread the decode part; the rest is taken as fixed."""
    decode_sd = curve.at("mean_itl_ms", batch) / 1000 * workload.output_len * workload.len_range_ratio / math.sqrt(3)
    return (decode_sd / curve.service_time_s(batch, workload.output_len)) ** 2


def _pct(used: float, available: float) -> str:
    return f"{100 * (1 - used / available):.0f}% headroom" if available > 0 else "no capacity"


def seq_kv_bytes(workload: Workload, memory: Memory) -> tuple[int, int]:
    """(KV bytes one sequence may take at its longest, its blocks)."""
    longest = math.ceil((workload.prompt_len + workload.output_len) * (1 + workload.len_range_ratio))
    blocks = math.ceil(longest / memory.block_size)
    return blocks * memory.block_size * memory.kv_bytes_per_token, blocks


def _check_max_model_len(workload: Workload, memory: Memory) -> None:
    if memory.max_model_len is None:
        return
    longest = math.ceil((workload.prompt_len + workload.output_len) * (1 + workload.len_range_ratio))
    if longest > memory.max_model_len:
        raise PlanError(f"a sequence of up to {longest} tokens (prompt + output) is longer than --max-model-len "
                        f"{memory.max_model_len}.")
    floor_bytes = math.ceil(memory.max_model_len / memory.block_size) * memory.block_size * memory.kv_bytes_per_token
    if floor_bytes > memory.kv_memory_per_replica:
        raise PlanError(f"one sequence of --max-model-len {memory.max_model_len} tokens needs {floor_bytes} bytes of "
                        f"KV cache, more than the {memory.kv_memory_per_replica} bytes a replica has.")


def _largest(curve: Curve, figure: Callable[[int], float], slo: float) -> int:
    """The largest batch (<= the largest measured) whose figure meets the SLO; 0 when none does. Figures grow
    with the batch, so it searches from the top."""
    for b in range(curve.max_batch, 0, -1):
        if figure(b) <= slo:
            return b
    return 0


def _impossible(curve: Curve, what: str, slo: float, value: float, how: str) -> PlanError:
    where = ("batch 1" if curve.min_batch == 1
             else f"the smallest measured concurrency {curve.min_batch} (measure smaller ones)")
    return PlanError(f"{what} SLO {slo:g} ms is below the p99 {what} at {where}, {value:.1f} ms ({how}): no batch "
                     f"size meets it on this hardware.")


def _fit(workload: Workload, curve: Curve, b_mem: int, max_replicas: int) -> dict[str, Any]:
    """The fewest replicas R whose per-replica rate lambda / R leaves a batch m meeting the ITL SLO (bench/
    plan_itl.py), a full replica keeping up, and the queueing bound on TTFT holding (method steps 3-8)."""
    lam, prompt, out = workload.arrival_rate, workload.prompt_len, workload.output_len
    b_ttft = _largest(curve, lambda b: curve.at("p99_ttft_ms", b), workload.ttft_slo_ms)
    if not b_ttft:
        raise _impossible(curve, "TTFT", workload.ttft_slo_ms, curve.at("p99_ttft_ms", 1), "measured")
    if not _largest(curve, lambda b: curve.p99_itl_open_ms(b, prompt, 0.0), workload.itl_slo_ms):
        raise _impossible(curve, "ITL", workload.itl_slo_ms, curve.p99_itl_open_ms(1, prompt, 0.0),
                          "measured, or mean ITL + the prefills of a step at its p99, at a trickle of arrivals")

    def service(b: int) -> float:
        return curve.service_time_s(b, out)

    top = min(b_ttft, b_mem, curve.max_batch)
    best = max(b / service(b) for b in range(1, top + 1))  # no replica serves more than this
    replicas = math.floor(lam / best) + 1
    failed = "throughput"  # why replicas - 1 did not do
    while replicas <= max_replicas:
        rate = lam / replicas
        b_itl = _largest(curve, lambda b, r=rate: curve.p99_itl_open_ms(b, prompt, r), workload.itl_slo_ms)
        m = min(b_itl, b_ttft, b_mem)
        if m < 1:
            failed = "itl_slo"
        elif rate >= m / service(m):
            failed = "throughput"
        else:
            cv2 = service_cv2(workload, curve, m)
            wait = 1000 * p99_wait_s(rate, service, m, cv2)
            if curve.at("p99_ttft_ms", m) + wait <= workload.ttft_slo_ms:
                return {"replicas": replicas, "m": m, "b_itl": b_itl, "b_ttft": b_ttft, "wait": wait, "cv2": cv2,
                        "r_binding": failed}
            failed = "ttft_queueing"
        replicas += 1
    raise PlanError(f"more than {max_replicas} replicas would be needed to meet the SLOs.")


def plan(workload: Workload, curve: Curve, memory: Memory, max_replicas: int = 10_000) -> Plan:
    """The recommendation and each bound's figures (method: the module docstring)."""
    workload.validate()
    if memory.kv_bytes_per_token < 1 or memory.kv_memory_per_replica < 1 or memory.block_size < 1:
        raise PlanError("--kv-bytes-per-token, --kv-memory-per-replica and --block-size must be positive.")
    lam = workload.arrival_rate
    why: list[str] = [f"lambda = {workload.users:g} users x {workload.requests_per_user_per_minute:g} "
                      f"requests/user/minute / 60 = {lam:.3f} req/s"]
    per_seq, blocks_per_seq = seq_kv_bytes(workload, memory)
    _check_max_model_len(workload, memory)
    b_mem = memory.kv_memory_per_replica // per_seq
    if b_mem < 1:
        raise PlanError(f"one sequence of up to {blocks_per_seq * memory.block_size} tokens needs {per_seq} bytes "
                        f"of KV cache, more than the {memory.kv_memory_per_replica} bytes a replica has.")
    fit = _fit(workload, curve, b_mem, max_replicas)
    replicas, m, b_itl, b_ttft, wait, cv2 = (fit[k] for k in ("replicas", "m", "b_itl", "b_ttft", "wait", "cv2"))
    rate = lam / replicas
    p99_itl = curve.p99_itl_open_ms(m, workload.prompt_len, rate)
    why.append(f"ITL SLO at {rate:.3f} req/s per replica: the largest batch whose p99 ITL (measured, or mean ITL + "
               f"the prefills (of {curve.prefill_ms(workload.prompt_len):.1f} ms each) that join a step at its "
               f"p99) <= {workload.itl_slo_ms:g} ms is {b_itl} (measured up to {curve.max_batch}); with p99 TTFT "
               f"<= {workload.ttft_slo_ms:g} ms: {b_ttft}")
    why.append(f"memory: KV per sequence = {blocks_per_seq} blocks x {memory.block_size} tokens x "
               f"{memory.kv_bytes_per_token} B/token = {per_seq} B; {memory.kv_memory_per_replica} B fit {b_mem}")
    m_binding = ("memory" if m == b_mem else "measured_range" if m == curve.max_batch
                 else "itl_slo" if m == b_itl else "ttft_slo")
    why.append(f"--max-num-seqs = min({b_itl}, {b_ttft}, {b_mem}) = {m} (bound by {m_binding})")
    s_full = curve.service_time_s(m, workload.output_len)
    capacity = m / s_full
    r_tp = math.floor(lam / capacity) + 1
    why.append(f"throughput: S({m}) = {s_full:.3f} s, so a full replica serves {capacity:.3f} req/s; "
               f"replicas > {lam:.3f} / {capacity:.3f} = {lam / capacity:.2f}: {r_tp}")
    ttft_full = curve.at("p99_ttft_ms", m)
    why.append(f"queueing: p99 TTFT = {ttft_full:.1f} ms measured at batch {m} + {wait:.1f} ms p99 wait for a slot "
               f"(birth-death queue, {m} slots, {rate:.3f} req/s each, service CV^2 {cv2:.2f}) with "
               f"{replicas} replicas")
    r_binding = fit["r_binding"]
    why.append(f"replicas: {replicas}, the fewest that meet every bound; {replicas - 1} fail the {r_binding} bound"
               if replicas > 1 else "replicas: 1")

    b_load = 1.0
    for _ in range(100):  # L/R = (lambda/R) x S(L/R), capped at m
        b_load = min(m, lam / replicas * curve.service_time_s(b_load, workload.output_len))
    little = lam * curve.service_time_s(b_load, workload.output_len)
    slots = replicas * m
    why.append(f"Little's law: L = {lam:.3f} req/s x S({b_load:.1f}) = {little:.1f} concurrent of {slots} slots "
               f"= {_pct(little, slots)}")
    kv_bytes = m * per_seq
    num_blocks = m * blocks_per_seq
    if memory.max_model_len is not None:
        floor_blocks = math.ceil(memory.max_model_len / memory.block_size)
        if floor_blocks > num_blocks:  # the engine refuses a pool smaller than one --max-model-len sequence
            num_blocks = floor_blocks
            kv_bytes = floor_blocks * memory.block_size * memory.kv_bytes_per_token
            why.append(f"--kv-cache-memory-bytes raised to {kv_bytes} B: the pool must hold one sequence of "
                       f"--max-model-len {memory.max_model_len} ({floor_blocks} blocks)")
    bounds = {
        "itl_slo": {"max_batch": b_itl, "p99_itl_ms_at_max_num_seqs": p99_itl, "slo_ms": workload.itl_slo_ms,
                    "replica_arrival_rate": rate, "headroom": 1 - p99_itl / workload.itl_slo_ms},
        "ttft_slo": {"max_batch": b_ttft, "p99_ttft_ms_predicted": ttft_full + wait, "p99_wait_ms": wait,
                     "slo_ms": workload.ttft_slo_ms, "headroom": 1 - (ttft_full + wait) / workload.ttft_slo_ms},
        "memory": {"max_batch": b_mem, "kv_bytes_per_sequence": per_seq, "kv_bytes_needed": kv_bytes,
                   "kv_bytes_available": memory.kv_memory_per_replica,
                   "headroom": 1 - kv_bytes / memory.kv_memory_per_replica,
                   "kv_bytes_at_load": b_load * per_seq},
        "throughput": {"per_replica_req_s": capacity, "arrival_rate": lam, "min_replicas": r_tp,
                       "headroom": 1 - lam / (replicas * capacity)},
        "littles_law": {"concurrent": little, "slots": slots, "batch_per_replica": b_load,
                        "service_time_s": curve.service_time_s(b_load, workload.output_len),
                        "headroom": 1 - little / slots},
    }
    result = Plan(replicas=replicas, max_num_seqs=m, kv_cache_memory_bytes=kv_bytes, num_blocks=num_blocks,
                  binding={"max_num_seqs": m_binding, "replicas": r_binding}, bounds=bounds, reasoning=why)
    result.warnings = _warnings(workload, curve, m)
    return result


def _warnings(workload: Workload, curve: Curve, m: int) -> list[str]:
    out = []
    for what, mine, measured in (("prompt", workload.prompt_len, curve.mean_input_len),
                                 ("output", workload.output_len, curve.mean_output_len)):
        if not 0.5 <= mine / measured <= 2:
            out.append(f"the workload's {what} length {mine} is far from the bench results' mean {measured:.0f}: "
                       f"TTFT and ITL scale with it; measure at the workload's lengths.")
    if m == curve.max_batch:
        out.append(f"--max-num-seqs is the largest measured concurrency {m}: measure larger ones to see if more fit.")
    return out


def format_plan(result: Plan, workload: Workload, curve: Curve) -> str:
    b = result.bounds
    lines = [
        f"Recommendation: {result.replicas} replica(s), each `--max-num-seqs {result.max_num_seqs} "
        f"--kv-cache-memory-bytes {result.kv_cache_memory_bytes}` ({result.num_blocks} blocks)",
        "",
        f"Workload: {workload.users:g} users x {workload.requests_per_user_per_minute:g} requests/user/minute; "
        f"prompt {workload.prompt_len}, output {workload.output_len} tokens (mean"
        + (f", +-{workload.len_range_ratio:.0%})" if workload.len_range_ratio else ")")
        + f"; SLOs (p99): TTFT {workload.ttft_slo_ms:g} ms, ITL {workload.itl_slo_ms:g} ms",
        f"Measured curve ({len(curve.points)} file(s)):", curve.describe(),
        "",
        "Headroom per bound:",
        f"  Little's law: {b['littles_law']['concurrent']:.1f} concurrent of {b['littles_law']['slots']} slots = "
        f"{b['littles_law']['headroom']:.0%} headroom",
        f"  throughput:   {workload.arrival_rate:.3f} req/s of {result.replicas} x "
        f"{b['throughput']['per_replica_req_s']:.3f} req/s = {b['throughput']['headroom']:.0%} headroom",
        f"  memory:       {b['memory']['kv_bytes_needed']} B KV for {result.max_num_seqs} sequences of "
        f"{b['memory']['kv_bytes_available']} B = {b['memory']['headroom']:.0%} headroom "
        f"(at the load's mean batch: {b['memory']['kv_bytes_at_load']:.0f} B)",
        f"  ITL SLO:      p99 {b['itl_slo']['p99_itl_ms_at_max_num_seqs']:.1f} ms at batch {result.max_num_seqs} "
        f"of {workload.itl_slo_ms:g} ms = {b['itl_slo']['headroom']:.0%} headroom",
        f"  TTFT SLO:     p99 {b['ttft_slo']['p99_ttft_ms_predicted']:.1f} ms predicted of "
        f"{workload.ttft_slo_ms:g} ms = {b['ttft_slo']['headroom']:.0%} headroom",
        f"Binding: --max-num-seqs by {result.binding['max_num_seqs']}, replicas by {result.binding['replicas']}",
        "",
        "Reasoning:", *(f"  {line}" for line in result.reasoning),
        "",
        "Method:", METHOD,
    ]
    lines += [f"warning: {w}" for w in result.warnings]
    return "\n".join(lines)
