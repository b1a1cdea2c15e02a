"""Prometheus metrics with vLLM's names and a `model_name` label, on a private CollectorRegistry.

Dashboards and autoscalers written for `vllm serve` read these unchanged.

Several API servers (--api-server-count N) share the engine cores and the port, so a scrape reaches any one of
them: as vLLM, they run in prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set by the parent for
every API server before it imports prometheus_client), each writing its values to files there, and /metrics
renders them all. Counters and histograms are summed over the API servers: each counts its own requests, and the
engine core sends its step counters (prefix cache, preemptions, speculative decoding) to API server 0 alone. The
engine gauges take the most recent value written (`multiprocess_mode="mostrecent"`): every API server receives
them every step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from pagedllm import envs
from pagedllm.kv_transfer.stats import CONNECTOR_COUNTERS, split_stat_key
from pagedllm.messages import SchedulerStats, SpecDecodingStats
from pagedllm.metrics.loggers import IterationStats

FINISH_REASONS = ("stop", "length", "abort", "error")

_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0]
_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]
_ITERATION_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


class PrometheusStatLogger:
    """Owns the metrics; `record` applies one step's stats of one engine, `render` is the /metrics body.

    With num_engines > 1 (data parallelism) every engine series carries vLLM's `engine="<rank>"` label beside
    `model_name`: gauges and counters per replica, so `sum by (model_name)` gives the server's totals as before.
    With one engine the labels are `model_name` only, as they were. vllm:admission_rejections is the API
    server's own (a request refused before it reaches any replica): no engine label."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 cache_config_info: dict[str, str] | None = None, num_engines: int = 1):
        self.registry = registry or CollectorRegistry()
        if cache_config_info:  # vLLM's info gauge: constant 1, the cache configuration in its labels
            Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", sorted(cache_config_info),
                  registry=self.registry, multiprocess_mode="mostrecent").labels(**cache_config_info).set(1)
        self.model_name = model_name
        self.admission_rejections = Counter("vllm:admission_rejections",
                                            "Requests rejected because the waiting queue was full.",
                                            ["model_name"], registry=self.registry).labels(model_name=model_name)
        self.label_names = ["model_name", "engine"] if num_engines > 1 else ["model_name"]
        self.families = _Families(self.registry, self.label_names)
        self.engines = [_EngineSeries(self.families, self._labels(i)) for i in range(num_engines)]
        self.engine_sleep_state = Gauge(
            "vllm:engine_sleep_state", "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine "
            "is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            [*self.label_names, "sleep_state"], registry=self.registry)
        self.record_sleep_state()
        self.spec_decode: _SpecDecodeCounters | None = None  # made on the first step that reports speculation
        self.routed_tokens: Counter | None = None  # made on the first step that reports experts (a MoE model)
        self.kv_connector_counters: dict[str, Counter] = {}  # by name, made when a KV connector first reports it

    def record_sleep_state(self, sleeping: bool = False, level: int = 0) -> None:
        """vLLM's vllm:engine_sleep_state, for every engine (sleep mode: engine/sleep_mode.py)."""
        values = {"awake": int(not sleeping), "weights_offloaded": int(sleeping and level == 1),
                  "discard_all": int(sleeping and level == 2)}
        for engine in range(len(self.engines)):
            for state, value in values.items():
                self.engine_sleep_state.labels(**self._labels(engine), sleep_state=state).set(value)

    def _labels(self, engine: int) -> dict[str, str]:
        return {"model_name": self.model_name, "engine": str(engine)} if "engine" in self.label_names else {
            "model_name": self.model_name}

    def _record_spec_decode(self, stats: SpecDecodingStats, engine: int) -> None:
        if self.spec_decode is None:
            self.spec_decode = _SpecDecodeCounters(self.registry, self.label_names)
        self.spec_decode.record(self._labels(engine), stats)

    def _record_routed_tokens(self, counts: list[int], engine: int) -> None:
        """pagedllm:moe_routed_tokens{expert="i"}: tokens routed to expert i, summed over the layers (no vLLM
        equivalent); the balance across experts is the ratio of these series."""
        if self.routed_tokens is None:
            self.routed_tokens = Counter("pagedllm:moe_routed_tokens",
                                         "Tokens routed to each expert of a mixture-of-experts model, summed over "
                                         "its layers.", [*self.label_names, "expert"], registry=self.registry)
        labels = self._labels(engine)
        for expert, count in enumerate(counts):
            self.routed_tokens.labels(**labels, expert=str(expert)).inc(count)

    def _record_kv_connector(self, deltas: dict[str, float], engine: int) -> None:
        """A KV connector's counters, by the names it reports (kv_transfer/: e.g. the P/D connector's
        pagedllm:kv_transfer_received_bytes and vLLM's vllm:nixl_num_failed_transfers). A key "name|value" is
        a family of kv_transfer/stats.py with one more label (the offload tier's vllm:kv_offload_* by
        transfer_type or tier), made with its label name and documentation; an unknown name with a label is
        skipped."""
        labels = self._labels(engine)
        for key, delta in deltas.items():
            name, label = split_stat_key(key)
            label_name, doc = CONNECTOR_COUNTERS.get(name, (None, f"KV connector counter {name}."))
            if (label is None) != (label_name is None):
                continue
            counter = self.kv_connector_counters.get(name)
            if counter is None:
                counter = self.kv_connector_counters[name] = Counter(
                    name, doc, [*self.label_names, *([label_name] if label_name else [])], registry=self.registry)
            if delta > 0:
                (counter.labels(**labels, **{label_name: label}) if label_name else counter.labels(**labels)
                 ).inc(delta)

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               engine: int = 0) -> None:
        series = self.engines[engine]
        if scheduler_stats is not None:
            series.num_requests_running.set(scheduler_stats.num_running_reqs)
            series.num_requests_waiting.set(scheduler_stats.num_waiting_reqs)
            series.kv_cache_usage.set(scheduler_stats.kv_cache_usage)
            series.num_free_blocks.set(scheduler_stats.num_free_blocks)
            series.num_total_blocks.set(scheduler_stats.num_total_blocks)
            series.prefix_cache_queries.inc(scheduler_stats.prefix_cache_queries_delta)
            series.prefix_cache_hits.inc(scheduler_stats.prefix_cache_hits_delta)
            series.num_preemptions.inc(scheduler_stats.num_preemptions_delta)
            series.slo_shed_requests.inc(scheduler_stats.num_slo_shed_delta)
            if scheduler_stats.spec_decoding_stats is not None:
                self._record_spec_decode(scheduler_stats.spec_decoding_stats, engine)
            if scheduler_stats.expert_routed_tokens_delta is not None:
                self._record_routed_tokens(scheduler_stats.expert_routed_tokens_delta, engine)
            if scheduler_stats.kv_connector_stats_delta is not None:
                series.external_prefix_cache_queries.inc(scheduler_stats.external_prefix_cache_queries_delta)
                series.external_prefix_cache_hits.inc(scheduler_stats.external_prefix_cache_hits_delta)
                self._record_kv_connector(scheduler_stats.kv_connector_stats_delta, engine)
        if iteration_stats is None:
            return
        s = iteration_stats
        series.prompt_tokens.inc(s.num_prompt_tokens)
        series.generation_tokens.inc(s.num_generation_tokens)
        if s.num_prompt_tokens or s.num_generation_tokens:
            series.iteration_tokens.observe(s.num_prompt_tokens + s.num_generation_tokens)
        for ttft in s.time_to_first_tokens:
            series.time_to_first_token.observe(ttft)
        for itl in s.inter_token_latencies:
            series.inter_token_latency.observe(itl)
        for finished in s.finished_requests:
            series.request_success[finished.finish_reason].inc()
            series.e2e_request_latency.observe(finished.e2e_latency)
            series.request_queue_time.observe(finished.queue_time)
            series.request_prefill_time.observe(finished.prefill_time)
            series.request_prompt_tokens.observe(finished.num_prompt_tokens)
            if not finished.is_pooling:  # an embedding generates nothing: no decode time, no generation tokens
                series.request_decode_time.observe(finished.decode_time)
                series.request_generation_tokens.observe(finished.num_generation_tokens)

    def remove_engine(self, engine: int) -> None:
        """The engine died: remove its gauges (requests running and waiting, KV-cache usage and blocks), which would
        otherwise show its last values as if it were still serving. Its counters and histograms keep their totals
        (a counter that vanished would read as a reset)."""
        values = list(self._labels(engine).values())
        for family in vars(self.families).values():
            if isinstance(family, Gauge):
                if _multiprocess_dir():  # removing is not implemented there: nothing runs on a dead engine
                    family.labels(*values).set(0)
                    continue
                with contextlib.suppress(KeyError):
                    family.remove(*values)
        for state in ("awake", "weights_offloaded", "discard_all"):
            with contextlib.suppress(KeyError):
                self.engine_sleep_state.remove(*values, state)

    def record_admission_rejection(self) -> None:
        self.admission_rejections.inc()

    def render(self) -> bytes:
        """The /metrics body."""
        return generate_latest(self._source())

    def collect(self) -> Iterable[Metric]:
        """The metric families render() formats, unformatted (the live page's figures: metrics/live_samples.py)."""
        return self._source().collect()

    def _source(self) -> CollectorRegistry:
        if _multiprocess_dir():
            from prometheus_client.multiprocess import MultiProcessCollector

            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            return registry
        return self.registry


def _multiprocess_dir() -> str | None:
    """prometheus_client's multiprocess directory (several API servers), None in a single process."""
    return envs.PROMETHEUS_MULTIPROC_DIR


class _Families:
    """Every per-engine metric family, made once per registry with the label names of the engine series."""

    def __init__(self, registry: CollectorRegistry, names: list[str]):
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=registry, multiprocess_mode="mostrecent")

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=registry)

        self.num_requests_running = gauge("vllm:num_requests_running", "Requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.num_free_blocks = gauge("pagedllm:kv_cache_free_blocks", "Free KV-cache blocks.")
        self.num_total_blocks = gauge("pagedllm:kv_cache_total_blocks", "KV-cache blocks in the pool.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.")
        self.external_prefix_cache_queries = counter(
            "vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance "
            "cache sharing, in terms of number of queried tokens.")
        self.external_prefix_cache_hits = counter(
            "vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache "
            "sharing, in terms of number of cached tokens.")
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.slo_shed_requests = counter("pagedllm:slo_shed_requests", "Requests refused early by "
                                         "--scheduling-policy slo: their ttft_slo_ms deadline was out of reach.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = Counter("vllm:request_success", "Count of finished requests by finish reason.",
                                       [*names, "finished_reason"], registry=registry)
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds",
                                             "Histogram of end-to-end request latency in seconds.",
                                             _REQUEST_BUCKETS)
        self.request_queue_time = histogram("vllm:request_queue_time_seconds",
                                            "Histogram of time spent waiting in the queue.", _REQUEST_BUCKETS)
        self.request_prefill_time = histogram("vllm:request_prefill_time_seconds",
                                              "Histogram of time spent in prefill.", _REQUEST_BUCKETS)
        self.request_decode_time = histogram("vllm:request_decode_time_seconds",
                                             "Histogram of time spent in decode.", _REQUEST_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", _TOKEN_BUCKETS)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of tokens per engine step.", _ITERATION_BUCKETS)


class _EngineSeries:
    """One engine's series of every family (its label values bound once, not per step)."""

    def __init__(self, families: _Families, labels: dict[str, str]):
        for name, family in vars(families).items():
            if name != "request_success":
                setattr(self, name, family.labels(**labels))
        self.request_success = {reason: families.request_success.labels(**labels, finished_reason=reason)
                                for reason in FINISH_REASONS}


class _SpecDecodeCounters:
    """vLLM's speculative decoding counters (only when speculation is configured, as in vLLM)."""

    def __init__(self, registry: CollectorRegistry, names: list[str]):
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry)

        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                               "Accepted tokens per draft position.", [*names, "position"], registry=registry)

    def record(self, labels: dict[str, str], stats: SpecDecodingStats) -> None:
        self.num_drafts.labels(**labels).inc(stats.num_drafts)
        self.num_draft_tokens.labels(**labels).inc(stats.num_draft_tokens)
        self.num_accepted_tokens.labels(**labels).inc(stats.num_accepted_tokens)
        for position, accepted in enumerate(stats.num_accepted_tokens_per_pos):
            self.per_pos.labels(**labels, position=str(position)).inc(accepted)
