"""Serving metrics from timed requests, and the summary table, with `vllm bench serve`'s definitions.

For each successful request with n output tokens: TTFT = first token time; TPOT = (E2EL - TTFT) / (n - 1),
only when n > 1; its ITLs are the gaps between streamed chunks, pooled across requests; E2EL = last token
time. Every statistic is reported in milliseconds: mean, median, std (population) and
`numpy.percentile` (linear interpolation) at the chosen percentiles.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from pagedllm.bench.request_func import RequestFuncOutput

logger = logging.getLogger(__name__)

# --percentile-metrics name -> (label, section header). The two queue metrics exist only with
# --max-concurrency, and the queue-inclusive latency only with a finite --request-rate as well.
PERCENTILE_METRICS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
    "client_queue_time": ("Client Queue Time", "Client-side Queueing"),
    "e2el_including_client_queue": ("E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency"),
}


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    retried: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    # metric name ("ttft", "tpot", "itl", "e2el") -> samples in seconds, successful requests only
    samples_s: dict[str, list[float]]


def calculate_metrics(
    outputs: list[RequestFuncOutput],
    dur_s: float,
    tokenizer=None,
    goodput_slos_ms: dict[str, float] | None = None,
) -> tuple[BenchmarkMetrics, list[int]]:
    """Aggregate request outputs over a run of `dur_s` seconds.

    The output length of a request is the server's `completion_tokens`; a server that sends no usage has
    its text re-tokenized with `tokenizer` (or counts 1 token without one).

    Returns:
        (metrics, output length per request, 0 for failed requests).
    """
    output_lens: list[int] = []
    samples: dict[str, list[float]] = {"ttft": [], "tpot": [], "itl": [], "e2el": []}
    tpot_or_zero: list[float] = []  # one per success, 0 when n <= 1: what goodput compares
    total_input = 0
    for out in outputs:
        if not out.success:
            output_lens.append(0)
            continue
        num_tokens = out.output_tokens or _count_tokens(out.generated_text, tokenizer)
        output_lens.append(num_tokens)
        total_input += out.prompt_len
        tpot = (out.latency - out.ttft) / (num_tokens - 1) if num_tokens > 1 else 0.0
        if num_tokens > 1:
            samples["tpot"].append(tpot)
        tpot_or_zero.append(tpot)
        samples["ttft"].append(out.ttft)
        samples["itl"] += out.itl
        samples["e2el"].append(out.latency)

    successes = [out for out in outputs if out.success]
    failures = [out for out in outputs if not out.success]
    for i, out in enumerate(failures[:10]):
        logger.warning("Failed request %d: %s", i, out.error)
    if not successes:
        logger.warning("All requests failed: check the benchmark's arguments and the server.")
    good = _count_good(samples["ttft"], tpot_or_zero, samples["e2el"], goodput_slos_ms or {})
    total_output = sum(output_lens)
    max_tokens_per_s, max_concurrent = peak_rates(successes)
    metrics = BenchmarkMetrics(
        completed=len(successes),
        failed=len(failures),
        retried=sum(out.retries for out in outputs),
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(successes) / dur_s,
        request_goodput=good / dur_s,
        output_throughput=total_output / dur_s,
        total_token_throughput=(total_input + total_output) / dur_s,
        max_output_tokens_per_s=max_tokens_per_s,
        max_concurrent_requests=max_concurrent,
        samples_s=samples,
    )
    return metrics, output_lens


def _count_tokens(text: str, tokenizer) -> int:
    if tokenizer is None:
        return 1
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def _count_good(ttfts: list[float], tpots: list[float], e2els: list[float], slos_ms: dict[str, float]) -> int:
    """Requests that meet every service-level objective given (`--goodput ttft:MS tpot:MS e2el:MS`)."""
    if not slos_ms:
        return 0
    columns = {"ttft": ttfts, "tpot": tpots, "e2el": e2els}
    checks = [(columns[name], limit_ms / 1000) for name, limit_ms in slos_ms.items()]
    return sum(all(values[i] <= limit for values, limit in checks) for i in range(len(ttfts)))


def peak_rates(outputs: list[RequestFuncOutput]) -> tuple[float, int]:
    """The most output tokens, and the most requests active, in any one-second bucket counted from the
    first request's start (vLLM 0.32's definitions).

    A request's tokens arrive at start + ttft, then after each ITL; it is active in every bucket from the
    one it starts in to the one it ends in, both included. Example: requests over [0.2, 0.9] s and
    [0.95, 1.1] s are both active in bucket 0, so the peak is 2 though they never overlap.
    """
    if not outputs:
        return 0.0, 0
    t0 = min(out.start_time for out in outputs)
    t_end = max(out.start_time + out.latency for out in outputs)
    num_buckets = int(np.ceil(t_end - t0)) + 1
    tokens_per_s = np.zeros(num_buckets)
    active_per_s = np.zeros(num_buckets)
    for out in outputs:
        token_times = out.start_time + out.ttft + np.concatenate(([0.0], np.cumsum(out.itl)))
        buckets = (token_times - t0).astype(int)
        buckets = buckets[(buckets >= 0) & (buckets < num_buckets)]
        np.add.at(tokens_per_s, buckets, 1)
        active_per_s[int(out.start_time - t0):int(out.start_time + out.latency - t0) + 1] += 1
    return float(tokens_per_s.max()), int(active_per_s.max())


def percentile_stats(samples_s: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean/median/std and each `pNN` of `samples_s`, in milliseconds; all zero for no samples."""
    values = np.asarray(samples_s or [0.0], dtype=float) * 1000
    stats = {"mean": float(np.mean(values)), "median": float(np.median(values)), "std": float(np.std(values))}
    for p in percentiles:
        stats[f"p{percentile_word(p)}"] = float(np.percentile(values, p))
    return stats


def percentile_word(p: float) -> str:
    """99.0 -> "99", 99.9 -> "99.9": how a percentile is spelled in keys and labels."""
    return str(int(p)) if int(p) == p else str(p)
