"""Frontend stats, the Prometheus names and the 10-second log line, from hand-built engine outputs."""

from __future__ import annotations

import logging

from pagedllm.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats
from pagedllm.metrics.loggers import LoggingStatLogger, RequestStatsTracker
from pagedllm.metrics.prometheus import PrometheusStatLogger


def test_tracker_times_and_prometheus_names():
    tracker = RequestStatsTracker()
    tracker.add("a", arrival_time=100.0, num_prompt_tokens=7)
    first = tracker.update(EngineCoreOutputs(outputs=[EngineCoreOutput(
        request_id="a", new_token_ids=[5], first_scheduled_time=100.5)]), now=101.0)
    assert first.num_prompt_tokens == 7 and first.time_to_first_tokens == [1.0]
    last = tracker.update(EngineCoreOutputs(outputs=[EngineCoreOutput(
        request_id="a", new_token_ids=[6, 7], finish_reason=FinishReason.LENGTH)]), now=102.0)
    assert last.num_generation_tokens == 2 and last.inter_token_latencies == [0.5]
    (done,) = last.finished_requests
    assert (done.finish_reason, done.e2e_latency, done.queue_time, done.prefill_time, done.decode_time) == \
        ("length", 2.0, 0.5, 0.5, 1.0)

    prometheus = PrometheusStatLogger("m")
    stats = SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25,
                           prefix_cache_queries_delta=32, prefix_cache_hits_delta=16, num_preemptions_delta=1)
    prometheus.record(stats, first)
    prometheus.record(None, last)
    prometheus.record_admission_rejection()
    text = prometheus.render().decode()
    for line in ('vllm:num_requests_running{model_name="m"} 2.0', 'vllm:num_requests_waiting{model_name="m"} 1.0',
                 'vllm:kv_cache_usage_perc{model_name="m"} 0.25', 'vllm:prefix_cache_hits_total{model_name="m"} 16.0',
                 'vllm:prefix_cache_queries_total{model_name="m"} 32.0',
                 'vllm:num_preemptions_total{model_name="m"} 1.0', 'vllm:prompt_tokens_total{model_name="m"} 7.0',
                 'vllm:generation_tokens_total{model_name="m"} 3.0',
                 'vllm:request_success_total{finished_reason="length",model_name="m"} 1.0',
                 'vllm:admission_rejections_total{model_name="m"} 1.0',
                 'vllm:e2e_request_latency_seconds_count{model_name="m"} 1.0',
                 'vllm:iteration_tokens_total_count{model_name="m"} 2.0'):
        assert line in text, line
    assert PrometheusStatLogger("other").registry is not prometheus.registry


def test_log_line(caplog):
    logger = LoggingStatLogger(interval_s=10.0)
    logger.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.5,
                                 prefix_cache_queries_delta=100, prefix_cache_hits_delta=25), None)
    with caplog.at_level(logging.INFO, logger="pagedllm.metrics.loggers"):
        logger.log()
    (message,) = [r.getMessage() for r in caplog.records]
    assert "Avg prompt throughput" in message and "Avg generation throughput" in message
    assert "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 50.0%, Prefix cache hit rate: 25.0%" in message
