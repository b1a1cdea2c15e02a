"""`pagedllm bench latency`: how long one batch takes end to end, and each engine step within it.

Each iteration generates `--output-len` tokens (greedy, `ignore_eos`) for `--batch-size` prompts of
`--input-len` random ids, driving the engine one step at a time and timing every step. All requests of the
batch advance together, so the last output_len - 1 steps of an iteration are decode steps and the steps
before them computed the prompts (the prefill, ending with each request's first token).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from typing import Any

import numpy as np

from pagedllm.bench.engine_args import add_engine_args, engine_kwargs

logger = logging.getLogger(__name__)

PERCENTAGES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="Hugging Face folder or GGUF file; default: the engine's.")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters-warmup", type=int, default=2)
    parser.add_argument("--num-iters", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None, help="Write the result to this JSON file.")
    add_engine_args(parser)


def run(args: argparse.Namespace, llm=None) -> dict[str, Any]:
    """Run the benchmark on `llm`, or on a new LLM built from the flags. Returns vLLM's latency JSON keys
    plus the prefill and per-step decode times."""
    from pagedllm import LLM, SamplingParams

    if args.output_len < 2:
        raise ValueError("--output-len must be at least 2 to time a decode step.")
    llm = llm or LLM(model=args.model, seed=args.seed, **engine_kwargs(args))
    vocab_size = len(llm.get_tokenizer())
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, min(10000, vocab_size), size=(args.batch_size, args.input_len)).tolist()
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    engine = llm.llm_engine
    # Prefix caching would turn every iteration after the first into a cache hit: vary the first token.
    salt = iter(range(1_000_000))

    def timed() -> tuple[float, list[float]]:
        """One iteration: (end-to-end seconds, seconds of each engine step)."""
        batch = [[next(salt) % vocab_size] + p[1:] for p in prompts]
        start = time.perf_counter()
        for prompt in batch:
            engine.add_request(f"latency-{next(salt)}", prompt, params, output_kind="final_only")
        step_s = []
        while engine.has_unfinished_requests():
            step_start = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - step_start)
        return time.perf_counter() - start, step_s

    for _ in range(args.num_iters_warmup):
        timed()
    runs = [timed() for _ in range(args.num_iters)]
    latencies = np.array([total for total, _ in runs])
    num_decode = args.output_len - 1
    prefill_latencies = np.array([sum(steps[:-num_decode]) for _, steps in runs])
    decode_steps = np.array([s for _, steps in runs for s in steps[-num_decode:]])
    step_s = float(np.median(decode_steps))
    return {
        "model_id": args.model,
        "avg_latency": float(np.mean(latencies)),
        "latencies": latencies.tolist(),
        "percentiles": dict(zip(PERCENTAGES, np.percentile(latencies, PERCENTAGES).tolist(), strict=True)),
        "median_prefill_latency": float(np.median(prefill_latencies)),
        "decode_step_time": step_s,
        "decode_step_time_p99": float(np.percentile(decode_steps, 99)),
        "decode_tokens_per_second": args.batch_size / step_s,
    }


def format_result(result: dict[str, Any]) -> str:
    lines = [f"Avg latency: {result['avg_latency']} seconds"]
    lines += [f"{p}% percentile latency: {v} seconds" for p, v in result["percentiles"].items()]
    lines.append(f"Median prefill latency: {result['median_prefill_latency']} seconds")
    lines.append(f"Decode step time: {result['decode_step_time'] * 1000:.2f} ms median, "
                 f"{result['decode_step_time_p99'] * 1000:.2f} ms p99 "
                 f"({result['decode_tokens_per_second']:.1f} tokens/s for the batch)")
    return "\n".join(lines)


def save(result: dict[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=4)
    logger.info("Saved the result to %s", path)
