"""A KV connector's counters reach /metrics with vLLM's names (external prefix cache, kv_offload by transfer type
and by tier) and the log line shows the external hit rate; an unknown family with a label is skipped, a zero
delta adds no sample."""

from __future__ import annotations

import logging

from pagedllm.executor.kv_output_aggregator import KVOutputAggregator
from pagedllm.kv_transfer.stats import stat_key
from pagedllm.messages import KVConnectorOutput, SchedulerStats
from pagedllm.metrics.loggers import LoggingStatLogger
from pagedllm.metrics.prometheus import PrometheusStatLogger


def test_connector_counters_in_prometheus_and_the_log_line(caplog):
    stats = SchedulerStats(num_running_reqs=1, external_prefix_cache_queries_delta=64,
                           external_prefix_cache_hits_delta=48,
                           kv_connector_stats_delta={stat_key("vllm:kv_offload_tiering_block_hits", "0:primary"): 2,
                                               stat_key("vllm:kv_offload_tiering_block_hits", "1:disk"): 1,
                                               stat_key("vllm:kv_offload_total_bytes", "CPU_to_GPU"): 4096,
                                               stat_key("pagedllm:kv_offload_load_errors"): 1,
                                               "someone:else|x": 5,
                                               stat_key("vllm:kv_offload_total_time", "GPU_to_CPU"): 0})
    prometheus = PrometheusStatLogger("m", num_engines=2)
    prometheus.record(stats, None, engine=1)
    prometheus.record(stats, None, engine=1)
    text = prometheus.render().decode()
    for line in ('vllm:external_prefix_cache_queries_total{engine="1",model_name="m"} 128.0',
                 'vllm:external_prefix_cache_hits_total{engine="1",model_name="m"} 96.0',
                 'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 0.0',
                 'vllm:kv_offload_tiering_block_hits_total{engine="1",model_name="m",tier="0:primary"} 4.0',
                 'vllm:kv_offload_tiering_block_hits_total{engine="1",model_name="m",tier="1:disk"} 2.0',
                 'vllm:kv_offload_total_bytes_total{engine="1",model_name="m",transfer_type="CPU_to_GPU"} 8192.0',
                 'pagedllm:kv_offload_load_errors_total{engine="1",model_name="m"} 2.0'):
        assert line in text, line
    assert "someone:else" not in text and "vllm:kv_offload_total_time_total{" not in text  # unknown label, 0

    log = LoggingStatLogger()
    log.record(stats, None)
    with caplog.at_level(logging.INFO, logger="pagedllm.metrics.loggers"):
        log.log()
    assert "External prefix cache hit rate: 75.0%" in caplog.text


def test_ranks_counters_are_summed():
    aggregator = KVOutputAggregator(2)
    key = stat_key("vllm:kv_offload_total_bytes", "GPU_to_CPU")
    out = aggregator.aggregate([KVConnectorOutput(kv_connector_stats={key: 10}),
                                KVConnectorOutput(kv_connector_stats={key: 5})])
    assert out.kv_connector_stats == {key: 15}
