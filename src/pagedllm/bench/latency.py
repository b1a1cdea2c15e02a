"""`pagedllm bench latency`: how long one batch takes end to end, and one decode step within it.

Each iteration generates `--output-len` tokens (greedy, `ignore_eos`) for `--batch-size` prompts of
`--input-len` random ids. The same batch with one output token measures the prefill alone, so

    decode step time = (median batch latency - median prefill latency) / (output_len - 1)

e.g. 1.30 s for 128 tokens and 0.03 s for the prefill give (1.30 - 0.03) / 127 = 10 ms per step.
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
    full = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    prefill_only = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    # Prefix caching would turn every iteration after the first into a cache hit: vary the first token.
    salt = iter(range(1_000_000))

    def timed(params) -> float:
        batch = [[next(salt) % vocab_size] + p[1:] for p in prompts]
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in range(args.num_iters_warmup):
        timed(full)
    latencies = np.array([timed(full) for _ in range(args.num_iters)])
    prefill_latencies = np.array([timed(prefill_only) for _ in range(max(1, args.num_iters // 2))])
    step_s = (np.median(latencies) - np.median(prefill_latencies)) / (args.output_len - 1)
    return {
        "model_id": args.model,
        "avg_latency": float(np.mean(latencies)),
        "latencies": latencies.tolist(),
        "percentiles": dict(zip(PERCENTAGES, np.percentile(latencies, PERCENTAGES).tolist(), strict=True)),
        "median_prefill_latency": float(np.median(prefill_latencies)),
        "decode_step_time": float(step_s),
        "decode_tokens_per_second": float(args.batch_size / step_s) if step_s > 0 else float("inf"),
    }


def format_result(result: dict[str, Any]) -> str:
    lines = [f"Avg latency: {result['avg_latency']} seconds"]
    lines += [f"{p}% percentile latency: {v} seconds" for p, v in result["percentiles"].items()]
    lines.append(f"Median prefill latency: {result['median_prefill_latency']} seconds")
    lines.append(f"Decode step time: {result['decode_step_time'] * 1000:.2f} ms "
                 f"({result['decode_tokens_per_second']:.1f} tokens/s for the batch)")
    return "\n".join(lines)


def save(result: dict[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=4)
    logger.info("Saved the result to %s", path)
