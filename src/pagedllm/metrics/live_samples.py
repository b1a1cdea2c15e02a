"""The live page's figures (entrypoints/openai/live_page.py), read from the /metrics text itself.

Each sample reads the metric families `PrometheusStatLogger.collect()` returns, the very ones render() formats into
the /metrics body, so the page and a scrape agree (multiprocess mode included: both merge every API server's
values); it skips the text format and its parse. Samples are taken only when
a viewer asks, at most one a second however many viewers there are, and kept in a bounded ring: nothing runs on the
engine's hot path and nothing at all while nobody looks.

Windowed figures (tokens/s, prefix-cache hit rate, speculative acceptance, TTFT/ITL percentiles) are differences
between the newest sample and the oldest one in the window, as PromQL's `increase()` / `histogram_quantile()` over
`rate(..._bucket)` would give; the percentiles interpolate linearly inside a bucket as `histogram_quantile` does.
While the ring holds a single sample the window is "since the server started" (a baseline of zeros).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
          "kv_usage": "vllm:kv_cache_usage_perc"}
COUNTERS = {"prompt_tokens": "vllm:prompt_tokens", "generation_tokens": "vllm:generation_tokens",
            "prefix_queries": "vllm:prefix_cache_queries", "prefix_hits": "vllm:prefix_cache_hits",
            "preemptions": "vllm:num_preemptions", "requests": "vllm:request_success",
            "spec_drafts": "vllm:spec_decode_num_drafts", "spec_draft_tokens": "vllm:spec_decode_num_draft_tokens",
            "spec_accepted": "vllm:spec_decode_num_accepted_tokens"}
HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "itl": "vllm:inter_token_latency_seconds",
              "e2e": "vllm:e2e_request_latency_seconds"}
QUANTILES = (0.5, 0.9, 0.99)


@dataclass
class Sample:
    """One parse of the /metrics body: server totals, per-engine gauges, and the histograms' cumulative buckets."""

    t: float
    totals: dict[str, float] = field(default_factory=dict)
    """Gauges summed over engines (kv_usage: the fullest engine's) and counters summed over every label."""
    engines: dict[str, dict[str, float]] = field(default_factory=dict)
    """engine label ("0" without data parallelism) -> its running, waiting and kv_usage."""
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)
    """histogram key -> upper bound -> cumulative count (summed over engines)."""


def parse_sample(source: str | Iterable[Metric], t: float | None = None) -> Sample:
    """One sample from metric families, or from the text of a /metrics body."""
    families = text_string_to_metric_families(source) if isinstance(source, str) else source
    by_name = {v: k for k, v in {**GAUGES, **COUNTERS}.items()}
    hist_by_name = {v: k for k, v in HISTOGRAMS.items()}
    sample = Sample(t=time.time() if t is None else t)
    for family in families:
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            name = s.name.removesuffix("_total")
            key = by_name.get(name)
            if key in GAUGES:
                engine = sample.engines.setdefault(s.labels.get("engine", "0"), {})
                engine[key] = engine.get(key, 0.0) + s.value
            elif key is not None:
                sample.totals[key] = sample.totals.get(key, 0.0) + s.value
            elif name.endswith("_bucket") and name.removesuffix("_bucket") in hist_by_name:
                buckets = sample.buckets.setdefault(hist_by_name[name.removesuffix("_bucket")], {})
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
    for key in GAUGES:
        values = [e.get(key, 0.0) for e in sample.engines.values()] or [0.0]
        sample.totals[key] = max(values) if key == "kv_usage" else sum(values)
    return sample


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets {upper bound: count}; None without observations.
    A quantile in the +Inf bucket is the largest finite bound (as Prometheus answers)."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    total = buckets[bounds[-1]]
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


class LiveSamples:
    """The bounded ring of samples and the figures the page shows. `collect` returns the metric families (those of
    /metrics)."""

    def __init__(self, collect: Callable[[], Iterable[Metric]], window_s: float = 300.0, min_interval_s: float = 1.0,
                 max_samples: int = 600, clock: Callable[[], float] = time.time):
        self.collect = collect
        self.window_s = window_s
        self.min_interval_s = min_interval_s
        self.ring: deque[Sample] = deque(maxlen=max_samples)
        self.clock = clock
        self._lock = threading.Lock()

    def sample(self) -> Sample:
        """The newest sample, taken now unless the last one is younger than min_interval_s."""
        with self._lock:
            now = self.clock()
            if self.ring and now - self.ring[-1].t < self.min_interval_s:
                return self.ring[-1]
            sample = parse_sample(self.collect(), now)
            self.ring.append(sample)
            while self.ring and now - self.ring[0].t > self.window_s * 2:  # keep twice the window for the charts
                self.ring.popleft()
            return sample

    def figures(self, since: float = 0.0) -> dict:
        """What /dashboard/data answers (without the engines' health, which live_page.py adds); the charts' points
        are those newer than `since` (the page sends its newest, so each poll carries a few points, not the ring)."""
        newest = self.sample()
        with self._lock:
            ring = list(self.ring)
        in_window = [s for s in ring if newest.t - s.t <= self.window_s]
        base = in_window[0] if len(in_window) > 1 else Sample(t=newest.t)
        window_s = newest.t - base.t if len(in_window) > 1 else None
        delta = {k: newest.totals.get(k, 0.0) - base.totals.get(k, 0.0) for k in COUNTERS}
        per_s = (lambda k: delta[k] / window_s if window_s else None)
        latency = {}
        for key in HISTOGRAMS:
            now_b, base_b = newest.buckets.get(key, {}), base.buckets.get(key, {})
            diff = {le: c - base_b.get(le, 0.0) for le, c in now_b.items()}
            latency[key] = {f"p{round(q * 100)}": histogram_quantile(q, diff) for q in QUANTILES}
            latency[key]["count"] = max(diff.values(), default=0.0)
        return {
            "time": newest.t, "window_s": window_s,
            "now": {k: newest.totals.get(k, 0.0) for k in GAUGES},
            "totals": {k: newest.totals.get(k, 0.0) for k in COUNTERS},
            "window": {
                "prompt_tokens_per_s": per_s("prompt_tokens"), "generation_tokens_per_s": per_s("generation_tokens"),
                "requests_per_s": per_s("requests"), "preemptions": delta["preemptions"],
                "prefix_cache_hit_rate": _ratio(delta["prefix_hits"], delta["prefix_queries"]),
                "spec_acceptance_rate": _ratio(delta["spec_accepted"], delta["spec_draft_tokens"]),
                "spec_mean_acceptance_length": (None if not delta["spec_drafts"]
                                                else 1 + delta["spec_accepted"] / delta["spec_drafts"]),
                "spec_enabled": "spec_drafts" in newest.totals,
                **{f"{key}_seconds": value for key, value in latency.items()}},
            "series": _series(ring, since),
            "engine_gauges": newest.engines,
        }


def _series(ring: list[Sample], since: float) -> list[dict]:
    """One point per sample newer than `since` for the charts: gauges as they were, rates between consecutive
    samples."""
    first = len(ring)
    while first > 0 and ring[first - 1].t > since:
        first -= 1
    points = []
    for prev, cur in zip([None, *ring[:-1]][first:], ring[first:], strict=True):
        point = {"t": cur.t, **{k: cur.totals.get(k, 0.0) for k in GAUGES}}
        if prev is not None and cur.t > prev.t:
            dt = cur.t - prev.t
            d = {k: cur.totals.get(k, 0.0) - prev.totals.get(k, 0.0) for k in COUNTERS}
            point["generation_tokens_per_s"] = d["generation_tokens"] / dt
            point["prompt_tokens_per_s"] = d["prompt_tokens"] / dt
            point["prefix_cache_hit_rate"] = _ratio(d["prefix_hits"], d["prefix_queries"])
        points.append(point)
    return points
