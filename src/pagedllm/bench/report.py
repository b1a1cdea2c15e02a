"""The result of a serving benchmark: `vllm bench serve`'s JSON keys and summary table text."""

from __future__ import annotations

from typing import Any

from pagedllm.bench.metrics import PERCENTILE_METRICS, BenchmarkMetrics, percentile_stats
from pagedllm.bench.request_func import RequestFuncOutput

_ROW = "{:<40} {:<10}"
_ROW_FLOAT = "{:<40} {:<10.2f}"


# Per-request lists that vLLM keeps in the saved JSON only with --save-detailed.
DETAILED_FIELDS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


def build_result(
    metrics: BenchmarkMetrics,
    outputs: list[RequestFuncOutput],
    output_lens: list[int],
    duration_s: float,
    selected_metrics: list[str],
    percentiles: list[float],
    with_goodput: bool,
    max_concurrency: int | None,
    request_rate: float,
) -> dict[str, Any]:
    """The per-run part of the result JSON, in vLLM's key order: totals and rates, per-request lists,
    peaks, then mean/median/std/pNN in ms for each selected metric that applies to this run."""
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": metrics.completed,
        "failed": metrics.failed,
        **({"retried": metrics.retried} if metrics.retried else {}),  # not in vLLM's file: only when there were
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if with_goodput else None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [out.prompt_len for out in outputs],
        "output_lens": output_lens,
        "ttfts": [out.ttft for out in outputs],
        "itls": [out.itl for out in outputs],
        "latencies": [out.latency for out in outputs],
        "start_times": [out.start_time for out in outputs],
        "queue_times": [out.client_queue_time for out in outputs],
        "generated_texts": [out.generated_text for out in outputs],
        "errors": [out.error for out in outputs],
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        "rtfx": 0.0,  # vLLM's inverse real-time factor of audio input; always 0 for text
    }
    samples = dict(metrics.samples_s)
    if max_concurrency is not None:
        successes = [out for out in outputs if out.success]
        samples["client_queue_time"] = [out.client_queue_time for out in successes]
        if request_rate != float("inf"):
            samples["e2el_including_client_queue"] = [out.latency + out.client_queue_time for out in successes]
    for name in PERCENTILE_METRICS:
        if name in selected_metrics and name in samples:
            for stat, value in percentile_stats(samples[name], percentiles).items():
                result[f"{stat}_{name}_ms"] = value
    return result


def format_table(
    result: dict[str, Any],
    selected_metrics: list[str],
    max_concurrency: int | None,
    request_rate: float,
) -> str:
    """The summary `vllm bench serve` prints, line for line."""
    lines = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
        _ROW.format("Successful requests:", result["completed"]),
        _ROW.format("Failed requests:", result["failed"]),
    ]
    if result.get("retried"):
        lines.append(_ROW.format("Retried requests:", result["retried"]))
    if max_concurrency is not None:
        lines.append(_ROW.format("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(_ROW_FLOAT.format("Request rate configured (RPS):", request_rate))
    lines += [
        _ROW_FLOAT.format("Benchmark duration (s):", result["duration"]),
        _ROW.format("Total input tokens:", result["total_input_tokens"]),
        _ROW.format("Total generated tokens:", result["total_output_tokens"]),
        _ROW_FLOAT.format("Request throughput (req/s):", result["request_throughput"]),
    ]
    if result["request_goodput"] is not None:
        lines.append(_ROW_FLOAT.format("Request goodput (req/s):", result["request_goodput"]))
    lines += [
        _ROW_FLOAT.format("Output token throughput (tok/s):", result["output_throughput"]),
        _ROW_FLOAT.format("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"]),
        _ROW_FLOAT.format("Peak concurrent requests:", result["max_concurrent_requests"]),
        _ROW_FLOAT.format("Total token throughput (tok/s):", result["total_token_throughput"]),
    ]
    for name, (label, header) in PERCENTILE_METRICS.items():
        if name not in selected_metrics or f"mean_{name}_ms" not in result:
            continue
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(_ROW_FLOAT.format(f"Mean {label} (ms):", result[f"mean_{name}_ms"]))
        lines.append(_ROW_FLOAT.format(f"Median {label} (ms):", result[f"median_{name}_ms"]))
        for key, value in result.items():
            word, sep, rest = key[1:].partition("_")
            if key.startswith("p") and sep and rest == f"{name}_ms" and word.replace(".", "").isdigit():
                lines.append(_ROW_FLOAT.format(f"P{word} {label} (ms):", value))
    lines.append("=" * 50)
    return "\n".join(lines)
