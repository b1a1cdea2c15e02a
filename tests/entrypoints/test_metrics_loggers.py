"""Frontend stats, the Prometheus names and the 10-second log line, from hand-built engine outputs."""

from __future__ import annotations

import logging

from pagedllm.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats, SpecDecodingStats
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
    assert "Grammar" not in message  # no structured outputs in the interval


def test_log_line_counts_grammar_compiles_and_cache_hits(caplog):
    logger = LoggingStatLogger(interval_s=10.0)
    logger.record(SchedulerStats(num_running_reqs=1, grammar_compiles_delta=2, grammar_compile_seconds_delta=0.006,
                                 grammar_cache_hits_delta=3), None)
    logger.record(SchedulerStats(num_running_reqs=1, grammar_compiles_delta=1, grammar_compile_seconds_delta=0.003,
                                 grammar_cache_hits_delta=4), None)
    with caplog.at_level(logging.INFO, logger="pagedllm.metrics.loggers"):
        logger.log()
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.endswith("Prefix cache hit rate: 0.0%, Grammars compiled: 3 (avg 3.0 ms), Grammar cache hits: 7")


def _spec_stats(drafts: int, draft_tokens: int, per_pos: list[int]) -> SpecDecodingStats:
    return SpecDecodingStats(num_spec_tokens=len(per_pos), num_drafts=drafts, num_draft_tokens=draft_tokens,
                             num_accepted_tokens=sum(per_pos), num_accepted_tokens_per_pos=per_pos)


def test_spec_decode_counters_and_log_line(caplog):
    prometheus = PrometheusStatLogger("m")
    prometheus.record(SchedulerStats(), None)
    assert "spec_decode" not in prometheus.render().decode()  # only when speculation is configured, as vLLM
    for stats in (_spec_stats(4, 12, [3, 2, 1]), _spec_stats(2, 6, [2, 1, 0])):
        prometheus.record(SchedulerStats(spec_decoding_stats=stats), None)
    text = prometheus.render().decode()
    for line in ('vllm:spec_decode_num_drafts_total{model_name="m"} 6.0',
                 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 18.0',
                 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 9.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 5.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0'):
        assert line in text, line
    logger = LoggingStatLogger(interval_s=10.0)
    logger.record(SchedulerStats(num_running_reqs=1, spec_decoding_stats=_spec_stats(4, 12, [3, 2, 1])), None)
    logger.record(SchedulerStats(num_running_reqs=1, spec_decoding_stats=_spec_stats(2, 6, [2, 1, 0])), None)
    with caplog.at_level(logging.INFO, logger="pagedllm.metrics.loggers"):
        logger.log()
    spec_lines = [r.getMessage() for r in caplog.records if "SpecDecoding" in r.getMessage()]
    assert len(spec_lines) == 1
    assert "Mean acceptance length: 2.50" in spec_lines[0]  # 1 + 9 accepted / 6 drafts
    assert "Accepted: 9 tokens, Drafted: 18 tokens, Per-position acceptance rate: 0.833, 0.500, 0.167" in spec_lines[0]
    assert "Avg Draft acceptance rate: 50.0%" in spec_lines[0]
