"""What the live page costs the API server: one /dashboard/data answer (the registry's metric families read and
the figures computed) against one /metrics render alone, and against the same figures parsed from the /metrics text
(the first version), on a registry as a busy two-replica server with speculation has it; interleaved, medians of
several runs. Also the answer's size with and without `since` (the page sends its newest).

    PYTHONPATH=src .venv/bin/python benchmarks/live_page_cost.py [--runs 7] [--reps 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.messages import SchedulerStats, SpecDecodingStats
from pagedllm.metrics.live_samples import LiveSamples
from pagedllm.metrics.loggers import FinishedRequestStats, IterationStats
from pagedllm.metrics.prometheus import PrometheusStatLogger


def busy_logger() -> PrometheusStatLogger:
    logger = PrometheusStatLogger("m", registry=CollectorRegistry(), num_engines=2)
    for step in range(500):
        stats = SchedulerStats(num_running_reqs=4, num_waiting_reqs=1, kv_cache_usage=0.2, num_free_blocks=80,
                               num_total_blocks=100, prefix_cache_queries_delta=64, prefix_cache_hits_delta=48,
                               spec_decoding_stats=SpecDecodingStats(num_spec_tokens=3, num_drafts=4,
                                                                     num_draft_tokens=12, num_accepted_tokens=8,
                                                                     num_accepted_tokens_per_pos=[4, 3, 1]))
        it = IterationStats()
        it.num_generation_tokens, it.num_prompt_tokens = 8, 64
        it.time_to_first_tokens = [0.05 * (step % 40)]
        it.inter_token_latencies = [0.01 * (step % 30)] * 4
        if step % 10 == 0:
            it.finished_requests = [FinishedRequestStats("stop", 2.0, 64, 48, 0.1, 0.2, 1.7)]
        logger.record(stats, it, step % 2)
    return logger


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    logger = busy_logger()
    clock = [0.0]
    live = LiveSamples(logger.collect, clock=lambda: clock[0])
    parsed = LiveSamples(lambda: text_string_to_metric_families(logger.render().decode()), clock=lambda: clock[0])
    render_us, data_us, parsed_us = [], [], []
    for _ in range(args.runs):
        t = time.perf_counter()
        for _ in range(args.reps):
            logger.render()
        render_us.append((time.perf_counter() - t) / args.reps * 1e6)
        t = time.perf_counter()
        for _ in range(args.reps):
            clock[0] += 2.0  # a new sample each time (the page polls every 2 s)
            live.figures(since=clock[0] - 2.0)
        data_us.append((time.perf_counter() - t) / args.reps * 1e6)
        t = time.perf_counter()
        for _ in range(args.reps):
            clock[0] += 2.0
            parsed.figures(since=clock[0] - 2.0)
        parsed_us.append((time.perf_counter() - t) / args.reps * 1e6)
    full = len(json.dumps(live.figures(since=0.0)))
    clock[0] += 2.0
    incremental = len(json.dumps(live.figures(since=clock[0] - 2.0)))
    print(f"/metrics render: median {statistics.median(render_us):.0f} us; /dashboard/data figures (collect + "
          f"window): median {statistics.median(data_us):.0f} us; parsed from the text instead: median "
          f"{statistics.median(parsed_us):.0f} us; {len(live.ring)} samples in the ring; "
          f"answer {incremental} bytes with since, {full} bytes without")


if __name__ == "__main__":
    main()
