"""metrics/live_samples.py, the live page's figures, from a real PrometheusStatLogger's metrics (no server)."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from pagedllm.entrypoints.openai.live_page import STALL_S, engine_health
from pagedllm.messages import SchedulerStats, SpecDecodingStats
from pagedllm.metrics.live_samples import LiveSamples, histogram_quantile, parse_sample
from pagedllm.metrics.prometheus import PrometheusStatLogger


def test_histogram_quantile_interpolates_as_prometheus():
    buckets = {0.1: 0.0, 0.2: 10.0, 0.4: 20.0, math.inf: 20.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.2)  # rank 10: the top of the (0.1, 0.2] bucket
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.15)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.3)
    assert histogram_quantile(0.99, {1.0: 0.0, math.inf: 4.0}) == 1.0  # in +Inf: the largest finite bound
    assert histogram_quantile(0.5, {1.0: 0.0, math.inf: 0.0}) is None


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _stats(running: int, waiting: int, free: int, hits: int = 0, queries: int = 0,
           spec: SpecDecodingStats | None = None) -> SchedulerStats:
    return SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=1 - free / 100,
                          num_total_blocks=100, num_free_blocks=free, prefix_cache_hits_delta=hits,
                          prefix_cache_queries_delta=queries, spec_decoding_stats=spec)


def test_figures_are_the_metrics_values_and_windowed_differences():
    logger = PrometheusStatLogger("m", registry=CollectorRegistry(), num_engines=2)
    clock = Clock()
    live = LiveSamples(logger.collect, clock=clock)
    first = live.figures()
    assert first["window_s"] is None and first["now"] == {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    assert first["window"]["ttft_seconds"]["p50"] is None and not first["window"]["spec_enabled"]

    spec = SpecDecodingStats(num_spec_tokens=3, num_drafts=4, num_draft_tokens=12, num_accepted_tokens=9,
                             num_accepted_tokens_per_pos=[4, 3, 2])
    logger.record(_stats(3, 1, 40, hits=30, queries=100, spec=spec), None, 0)
    logger.record(_stats(2, 0, 90, hits=10, queries=100), None, 1)
    clock.t += 0.5
    assert live.figures()["now"]["running"] == 0.0  # younger than min_interval_s: the same sample
    clock.t += 9.5
    fig = live.figures()
    assert fig["window_s"] == pytest.approx(10.0)
    assert fig["now"] == {"running": 5.0, "waiting": 1.0, "kv_usage": pytest.approx(0.6)}  # the fullest engine
    assert fig["window"]["prefix_cache_hit_rate"] == pytest.approx(40 / 200)
    assert fig["window"]["spec_enabled"]
    assert fig["window"]["spec_acceptance_rate"] == pytest.approx(9 / 12)
    assert fig["window"]["spec_mean_acceptance_length"] == pytest.approx(1 + 9 / 4)
    assert fig["engine_gauges"]["0"]["running"] == 3.0 and fig["engine_gauges"]["1"]["kv_usage"] == pytest.approx(.1)
    assert [p["running"] for p in fig["series"]] == [0.0, 5.0]
    assert fig["series"][1]["prefix_cache_hit_rate"] == pytest.approx(0.2)
    assert live.figures(since=fig["series"][1]["t"])["series"] == []  # only points newer than the page's newest

    sample = parse_sample(logger.collect())  # counters summed over the engine label
    assert sample.totals["prefix_hits"] == 40 and sample.totals["prefix_queries"] == 200
    text = parse_sample(logger.render().decode())  # the /metrics body, parsed: the same figures
    assert (text.totals, text.engines, text.buckets) == (sample.totals, sample.engines, sample.buckets)


def test_the_window_and_the_ring_are_bounded():
    logger = PrometheusStatLogger("m", registry=CollectorRegistry())
    clock = Clock()
    live = LiveSamples(logger.collect, window_s=30.0, max_samples=50, clock=clock)
    for _ in range(80):
        live.sample()
        clock.t += 1.0
    assert len(live.ring) == 50
    assert live.figures()["window_s"] == pytest.approx(30.0)


def test_engine_health_per_replica_with_its_tp_pp_ranks():
    """live_page.engine_health: up, stalled (requests and no step for STALL_S), down (with the reason)."""
    now = time.monotonic()
    clients = [SimpleNamespace(is_dead=False, dead_reason=None, ready=SimpleNamespace(pid=10 + i)) for i in range(3)]
    clients[2].is_dead, clients[2].dead_reason = True, "killed"
    engine = SimpleNamespace(clients=clients, last_progress_time=[now, now - STALL_S - 1, now],
                             scheduler_stats=[_stats(1, 0, 90), _stats(0, 2, 100), _stats(0, 0, 100)])
    state = SimpleNamespace(engine=engine, parallel={"tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    replicas = engine_health(state, {"0": {"running": 1.0, "waiting": 0.0, "kv_usage": 0.1}})
    assert [r["status"] for r in replicas] == ["up", "stalled", "down"]
    assert replicas[2]["reason"] == "killed" and replicas[0]["running"] == 1.0 and replicas[1]["kv_usage"] == 0.0
    assert [(r["pp_rank"], r["tp_rank"]) for r in replicas[0]["ranks"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {r["status"] for r in replicas[2]["ranks"]} == {"down"}


def test_guard_lets_the_page_and_its_data_through_a_drain_and_a_dead_engine_but_not_past_the_key():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from pagedllm.entrypoints.openai.middleware import GuardMiddleware

    ok = Route("/{path:path}", lambda request: PlainTextResponse("ok"))
    config = SimpleNamespace(api_keys=["k"], protect_metrics=False, max_request_bytes=1 << 20)
    state = SimpleNamespace(config=config, draining=True, engine=SimpleNamespace(is_dead=True, dead_reason="gone"))
    client = TestClient(GuardMiddleware(Starlette(routes=[ok]), state))
    key = {"Authorization": "Bearer k"}
    for path in ("/", "/dashboard"):
        assert client.get(path).status_code == 200
    assert client.get("/dashboard/data").status_code == 401
    assert client.get("/dashboard/data", headers=key).status_code == 200
    assert client.get("/v1/models", headers=key).status_code == 503  # the API itself still refuses while draining
