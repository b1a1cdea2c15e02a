"""The measured latency curve `pagedllm plan` reads: TTFT and ITL against batch size, from `bench serve` results.

Each `pagedllm bench serve --save-result --max-concurrency C` file (vLLM's result format) is one point of the
curve at batch size C: its mean and p99 TTFT and ITL, its request and output throughput. The files of a sweep
over several concurrencies make a curve; between two measured batch sizes a figure is linearly interpolated;
below the smallest measured batch size it is the smallest one's figure (an over-estimate: latency grows with the
batch, so a smaller batch is at most as slow); above the largest one there is no figure, since nothing says how
fast latency grows there (the planner never recommends a batch larger than the largest measured concurrency).
One file is a curve too: its figures hold for every batch up to its concurrency, none above it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pagedllm.bench.plan_itl import p99_itl_poisson_ms

# The result keys the planner reads (vLLM's names, written by bench/report.py). p99 needs the default
# --metric-percentiles 99 and --percentile-metrics with ttft and itl.
_REQUIRED = ("request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms",
             "completed", "total_input_tokens", "total_output_tokens")


class PlanError(ValueError):
    """Inputs the planner cannot plan for; the message says which and why."""


@dataclass(frozen=True)
class BenchPoint:
    """One measured `bench serve` result at a fixed concurrency."""

    concurrency: int
    request_throughput: float  # req/s
    output_throughput: float  # tok/s
    mean_ttft_ms: float
    p99_ttft_ms: float
    mean_itl_ms: float
    p99_itl_ms: float
    mean_input_len: float
    mean_output_len: float
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def point_from_result(result: dict[str, Any], source: str = "") -> BenchPoint:
    """A `bench serve` result dict -> its BenchPoint; PlanError naming the file and the missing key."""
    missing = [key for key in _REQUIRED if result.get(key) is None]
    if missing:
        raise PlanError(f"{source or 'bench result'}: no {', '.join(missing)}; run `pagedllm bench serve "
                        f"--save-result --max-concurrency C` with the default --metric-percentiles 99 and "
                        f"--percentile-metrics including ttft,itl.")
    concurrency = result.get("max_concurrency")
    if concurrency is None:
        raise PlanError(f"{source or 'bench result'}: run without --max-concurrency, so its batch size is unknown; "
                        f"measure each point with `--max-concurrency C` (a sweep: C = 1, 2, 4, ...).")
    completed = int(result["completed"])
    if completed < 1 or int(concurrency) < 1:
        raise PlanError(f"{source or 'bench result'}: {completed} completed requests at concurrency {concurrency}; "
                        f"nothing to plan from.")
    return BenchPoint(
        concurrency=int(concurrency), request_throughput=float(result["request_throughput"]),
        output_throughput=float(result["output_throughput"]), mean_ttft_ms=float(result["mean_ttft_ms"]),
        p99_ttft_ms=float(result["p99_ttft_ms"]), mean_itl_ms=float(result["mean_itl_ms"]),
        p99_itl_ms=float(result["p99_itl_ms"]), mean_input_len=result["total_input_tokens"] / completed,
        mean_output_len=result["total_output_tokens"] / completed, source=source)


def load_points(paths: list[str]) -> list[BenchPoint]:
    """Read each result file; PlanError for an unreadable one."""
    points = []
    for path in paths:
        try:
            result = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise PlanError(f"{path}: not a readable bench result JSON ({e}).") from e
        if not isinstance(result, dict):
            raise PlanError(f"{path}: not a bench result (a JSON object).")
        points.append(point_from_result(result, path))
    return points


class Curve:
    """TTFT and ITL (mean, p99) and throughput against batch size, from one or more BenchPoints.

    Several files at one concurrency are averaged. `at(name, b)` interpolates as the module docstring says.
    """

    FIELDS = ("request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms")

    def __init__(self, points: list[BenchPoint]):
        if not points:
            raise PlanError("no bench results: give at least one `bench serve --save-result` file.")
        by_c: dict[int, list[BenchPoint]] = {}
        for p in points:
            by_c.setdefault(p.concurrency, []).append(p)
        self.points = points
        self.concurrencies = sorted(by_c)
        self.values = {name: [sum(getattr(p, name) for p in by_c[c]) / len(by_c[c]) for c in self.concurrencies]
                       for name in self.FIELDS}
        self.mean_input_len = sum(p.mean_input_len for p in points) / len(points)
        self.mean_output_len = sum(p.mean_output_len for p in points) / len(points)

    @property
    def max_batch(self) -> int:
        return self.concurrencies[-1]

    @property
    def min_batch(self) -> int:
        return self.concurrencies[0]

    def at(self, name: str, batch: float) -> float:
        """`name` (one of FIELDS) at batch size `batch` (<= max_batch)."""
        cs, vs = self.concurrencies, self.values[name]
        if batch > cs[-1]:
            raise PlanError(f"batch {batch} is above the largest measured concurrency {cs[-1]}.")
        if batch <= cs[0]:
            return vs[0]
        for i in range(1, len(cs)):
            if batch <= cs[i]:
                frac = (batch - cs[i - 1]) / (cs[i] - cs[i - 1])
                return vs[i - 1] + frac * (vs[i] - vs[i - 1])
        return vs[-1]

    def prefill_ms(self, prompt_len: float) -> float:
        """What one request's prefill adds to the step it joins: mean TTFT - mean ITL at the smallest measured
        batch, scaled from the results' mean prompt length to `prompt_len`."""
        c0 = self.min_batch
        return max(self.at("mean_ttft_ms", c0) - self.at("mean_itl_ms", c0), 0.0) * prompt_len / max(
            self.mean_input_len, 1.0)

    def p99_itl_open_ms(self, batch: float, prompt_len: float, rate_per_s: float) -> float:
        """p99 ITL under open-loop (Poisson) traffic at a replica's arrival rate: the measured p99, or a decode
        step at this batch plus the prefills that join it at its 99th percentile (bench/plan_itl.py), whichever
        is more. A closed-loop sweep admits one request as one leaves, so it under-counts steps with several."""
        return max(self.at("p99_itl_ms", batch),
                   p99_itl_poisson_ms(rate_per_s, self.at("mean_itl_ms", batch), self.prefill_ms(prompt_len)))

    def service_time_s(self, batch: float, output_len: float) -> float:
        """Seconds one request holds a slot at this batch size: mean TTFT + (output_len - 1) x mean ITL."""
        return (self.at("mean_ttft_ms", batch) + max(output_len - 1, 0) * self.at("mean_itl_ms", batch)) / 1000

    def describe(self) -> str:
        rows = [f"  batch {c:>4}: p99 TTFT {self.values['p99_ttft_ms'][i]:8.1f} ms, p99 ITL "
                f"{self.values['p99_itl_ms'][i]:7.1f} ms (mean {self.values['mean_itl_ms'][i]:6.1f}), "
                f"{self.values['request_throughput'][i]:.3f} req/s"
                for i, c in enumerate(self.concurrencies)]
        return "\n".join(rows)


def model_kv_bytes_per_token(model: str | None, kv_cache_dtype: str = "auto", dtype: str = "auto") -> tuple[int, str]:
    """(KV bytes per token, how it was worked out) for `model` on the CPU, read through pagedllm's own model config
    code (config.json or GGUF metadata, no weights): 2 (K, V) x layers x KV heads x head_dim x the KV dtype's size,
    the dtype resolved as `pagedllm serve` resolves it."""
    import torch

    from pagedllm.config.engine import ModelConfig
    from pagedllm.layers.kv_cache_dtype import resolve_kv_cache_dtype
    from pagedllm.models.loader import load_model_info, resolve_dtype

    config = ModelConfig(model=model, dtype=dtype)
    info = load_model_info(config)
    device = torch.device("cpu")
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, resolve_dtype(dtype, device, config), device)
    itemsize = torch.empty((), dtype=kv_dtype).element_size()
    per_token = 2 * info.num_layers * info.num_kv_heads * info.head_dim * itemsize
    return per_token, (f"2 x {info.num_layers} layers x {info.num_kv_heads} KV heads x {info.head_dim} head_dim x "
                       f"{itemsize} B ({str(kv_dtype).removeprefix('torch.')}) = {per_token} B/token")
