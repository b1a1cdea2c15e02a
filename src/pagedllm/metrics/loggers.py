"""Frontend request statistics and the periodic log line.

`RequestStatsTracker` turns each step's EngineCoreOutputs into `IterationStats` (tokens, time to first
token, inter-token latencies, finished requests with their queue/prefill/decode times). `LoggingStatLogger`
prints vLLM's 10-second summary: prompt and generation throughput, running, waiting, KV usage and
prefix-cache hit rate. The Prometheus logger (metrics/prometheus.py) consumes the same stats.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pagedllm.messages import EngineCoreOutputs, SchedulerStats, SpecDecodingStats

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_time: float
    prefill_time: float
    decode_time: float
    is_pooling: bool = False
    """A pooling request (an embedding): prompt tokens, e2e, queue and prefill times only."""
    time_to_first_token: float | None = None
    """None: it finished before its first token."""
    trace: object = None
    """What the tracer (--otlp-traces-endpoint) was given with the request, for its span; None untraced."""


@dataclass
class IterationStats:
    """What one engine step produced, as seen by the frontend."""

    num_prompt_tokens: int = 0
    """Prompt tokens of requests that produced their first token (or, an embedding, their vector) this step."""
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class _RequestTimes:
    arrival_time: float
    num_prompt_tokens: int
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0
    is_pooling: bool = False
    trace: object = None


class RequestStatsTracker:
    """Per-request timing, keyed by engine request id (each of n children counts as a request)."""

    def __init__(self) -> None:
        self._requests: dict[str, _RequestTimes] = {}

    def add(self, request_id: str, arrival_time: float, num_prompt_tokens: int, trace: object = None) -> None:
        self._requests[request_id] = _RequestTimes(arrival_time, num_prompt_tokens, trace=trace)

    def finish(self, request_id: str, finish_reason: str, stats: IterationStats | None = None,
               now: float | None = None) -> None:
        """End a request the frontend finished (abort, stop string, error)."""
        times = self._requests.pop(request_id, None)
        if times is not None and stats is not None:
            stats.finished_requests.append(_finished(times, finish_reason, now or time.time()))

    def update(self, outputs: EngineCoreOutputs, now: float | None = None) -> IterationStats:
        now = now or time.time()
        stats = IterationStats()
        for output in outputs.outputs:
            times = self._requests.get(output.request_id)
            if times is None:
                continue
            if output.first_scheduled_time is not None and times.first_scheduled_time is None:
                times.first_scheduled_time = output.first_scheduled_time
            num_new = len(output.new_token_ids)
            if num_new:
                if times.first_token_time is None:
                    times.first_token_time = now
                    stats.num_prompt_tokens += times.num_prompt_tokens
                    stats.time_to_first_tokens.append(now - times.arrival_time)
                else:
                    stats.inter_token_latencies.append((now - times.last_token_time) / num_new)
                times.last_token_time = now
                times.num_generation_tokens += num_new
                stats.num_generation_tokens += num_new
            if output.pooled is not None:  # an embedding: its prompt is computed, its vector out (no token)
                times.is_pooling = True
                stats.num_prompt_tokens += times.num_prompt_tokens
                stats.time_to_first_tokens.append(now - times.arrival_time)  # vLLM's: the time to the vector
                times.first_token_time = now  # the prefill ends here
            if output.finish_reason is not None:
                self.finish(output.request_id, str(output.finish_reason), stats, now)
        return stats


def _finished(times: _RequestTimes, finish_reason: str, now: float) -> FinishedRequestStats:
    scheduled = times.first_scheduled_time or times.arrival_time
    first_token = times.first_token_time or now
    return FinishedRequestStats(
        finish_reason=finish_reason, e2e_latency=now - times.arrival_time,
        num_prompt_tokens=times.num_prompt_tokens, num_generation_tokens=times.num_generation_tokens,
        queue_time=max(0.0, scheduled - times.arrival_time), prefill_time=max(0.0, first_token - scheduled),
        decode_time=max(0.0, (times.last_token_time or first_token) - first_token),
        time_to_first_token=None if times.first_token_time is None else times.first_token_time - times.arrival_time,
        trace=times.trace, is_pooling=times.is_pooling)


class LoggingStatLogger:
    """Accumulates stats and logs one summary line per interval (and one more once it goes idle)."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S, prefix: str = "") -> None:
        self.interval_s = interval_s
        self.prefix = prefix
        """Put before each line: vLLM's "Engine 000: " per data-parallel replica; empty with one engine."""
        self.scheduler_stats = SchedulerStats()
        self._reset(time.monotonic())
        self._was_active = False

    def _reset(self, now: float) -> None:
        self.last_log_time = now
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.external_queries = 0
        self.external_hits = 0
        self.spec: SpecDecodingStats | None = None
        self.grammar_compiles = 0
        self.grammar_compile_seconds = 0.0
        self.grammar_cache_hits = 0

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self.scheduler_stats = scheduler_stats
            self.prefix_queries += scheduler_stats.prefix_cache_queries_delta
            self.prefix_hits += scheduler_stats.prefix_cache_hits_delta
            self.external_queries += scheduler_stats.external_prefix_cache_queries_delta
            self.external_hits += scheduler_stats.external_prefix_cache_hits_delta
            self.grammar_compiles += scheduler_stats.grammar_compiles_delta
            self.grammar_compile_seconds += scheduler_stats.grammar_compile_seconds_delta
            self.grammar_cache_hits += scheduler_stats.grammar_cache_hits_delta
            if scheduler_stats.spec_decoding_stats is not None:
                self._add_spec(scheduler_stats.spec_decoding_stats)
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens

    def log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self.last_log_time, 1e-9)
        s = self.scheduler_stats
        active = bool(self.num_prompt_tokens or self.num_generation_tokens or s.num_running_reqs
                      or s.num_waiting_reqs)
        if active or self._was_active:
            hit_rate = self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
            logger.info("%sAvg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                        "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                        "Prefix cache hit rate: %.1f%%%s%s", self.prefix,
                        self.num_prompt_tokens / elapsed, self.num_generation_tokens / elapsed,
                        s.num_running_reqs, s.num_waiting_reqs, s.kv_cache_usage * 100, hit_rate * 100,
                        self._external_part(), self._grammar_part())
        if self.spec is not None and self.spec.num_drafts:
            _log_spec_decode(self.spec, elapsed)
        self._was_active = active
        self._reset(now)

    def _external_part(self) -> str:
        """A KV connector (an offload tier): vLLM's external prefix cache hit rate over the interval."""
        if not self.external_queries:
            return ""
        return f", External prefix cache hit rate: {100 * self.external_hits / self.external_queries:.1f}%"

    def _grammar_part(self) -> str:
        """Structured outputs in the interval: grammars compiled, their mean compile time, compile-cache hits."""
        if not (self.grammar_compiles or self.grammar_cache_hits):
            return ""
        mean_ms = 1000 * self.grammar_compile_seconds / max(self.grammar_compiles, 1)
        return (f", Grammars compiled: {self.grammar_compiles} (avg {mean_ms:.1f} ms), "
                f"Grammar cache hits: {self.grammar_cache_hits}")

    def _add_spec(self, stats: SpecDecodingStats) -> None:
        if self.spec is None:
            self.spec = SpecDecodingStats(num_spec_tokens=stats.num_spec_tokens,
                                          num_accepted_tokens_per_pos=[0] * stats.num_spec_tokens)
        total = self.spec
        total.num_drafts += stats.num_drafts
        total.num_draft_tokens += stats.num_draft_tokens
        total.num_accepted_tokens += stats.num_accepted_tokens
        for i, n in enumerate(stats.num_accepted_tokens_per_pos):
            total.num_accepted_tokens_per_pos[i] += n


def _log_spec_decode(s: SpecDecodingStats, elapsed: float) -> None:
    """vLLM's SpecDecoding metrics line: mean acceptance length counts the target's own token (1 + accepted per
    draft); per-position rates are accepted drafts at each position over the drafts verified."""
    per_pos = ", ".join(f"{n / s.num_drafts:.3f}" for n in s.num_accepted_tokens_per_pos)
    logger.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
                "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
                "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
                1 + s.num_accepted_tokens / s.num_drafts, s.num_accepted_tokens / elapsed,
                s.num_draft_tokens / elapsed, s.num_accepted_tokens, s.num_draft_tokens, per_pos,
                100 * s.num_accepted_tokens / max(s.num_draft_tokens, 1))
