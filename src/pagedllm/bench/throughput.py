"""`pagedllm bench throughput`: offline generation speed through `LLM.generate`.

The default is the standard offline workload of ../shared/bench: 128 prompts of 256 random token ids in
[100, 49000), 128 output tokens each, greedy, `ignore_eos`, after a short warm-up batch. Output and total
tokens per second are measured over the one timed `generate` call.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from typing import Any

from pagedllm.bench.engine_args import add_engine_args, engine_kwargs

logger = logging.getLogger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="Hugging Face folder or GGUF file; default: the engine's.")
    parser.add_argument("--dataset-name", default="random", choices=("random", "copy-heavy"),
                        help="random: --input-len random token ids; copy-heavy: prompts that ask to repeat, edit or "
                             "reformat given text or code, in the chat template (bench/copy_heavy.py).")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=256, help="Token ids per prompt.")
    parser.add_argument("--output-len", type=int, default=128, help="Tokens generated per prompt.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the random prompts and of the engine.")
    parser.add_argument("--num-warmup-prompts", type=int, default=4,
                        help="Prompts in the untimed warm-up batch (8 output tokens each); 0 skips it.")
    parser.add_argument("--output-json", default=None, help="Write the result to this JSON file.")
    add_engine_args(parser)


def random_token_prompts(rng: random.Random, num_prompts: int, input_len: int,
                         vocab_size: int = 49152) -> list[list[int]]:
    """Prompts of `input_len` ids drawn uniformly from [100, 49000), like ../shared/bench/offline_vllm.py;
    a smaller vocabulary shrinks the range to [vocab_size // 8, vocab_size)."""
    high = min(49000, vocab_size)
    low = min(100, high // 8)
    return [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(num_prompts)]


def run(args: argparse.Namespace, llm=None) -> dict[str, Any]:
    """Run the benchmark on `llm`, or on a new LLM built from the flags. Returns vLLM's throughput JSON
    keys plus the token counts and output rate."""
    from pagedllm import LLM, SamplingParams

    llm = llm or LLM(model=args.model, seed=args.seed, **engine_kwargs(args))
    rng = random.Random(args.seed)
    vocab_size = len(llm.get_tokenizer())
    if args.num_warmup_prompts > 0:
        warmup = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
        llm.generate(random_token_prompts(rng, args.num_warmup_prompts, args.input_len, vocab_size), warmup,
                     use_tqdm=False)
    if getattr(args, "dataset_name", "random") == "copy-heavy":
        from pagedllm.bench.copy_heavy import sample_copy_heavy

        samples = sample_copy_heavy(llm.get_tokenizer(), args.num_prompts, args.output_len, seed=args.seed)
        prompts = [llm.get_tokenizer().encode(s.prompt, add_special_tokens=False) for s in samples]
    else:
        prompts = random_token_prompts(rng, args.num_prompts, args.input_len, vocab_size)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    total = num_prompt_tokens + num_output_tokens
    return {
        "model_id": args.model,
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_num_tokens": total,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": num_output_tokens / elapsed,
        "total_prompt_tokens": num_prompt_tokens,
        "total_output_tokens": num_output_tokens,
    }


def format_result(result: dict[str, Any]) -> str:
    """vLLM's three summary lines."""
    return (f"Throughput: {result['requests_per_second']:.2f} requests/s, "
            f"{result['tokens_per_second']:.2f} total tokens/s, "
            f"{result['output_tokens_per_second']:.2f} output tokens/s\n"
            f"Total num prompt tokens:  {result['total_prompt_tokens']}\n"
            f"Total num output tokens:  {result['total_output_tokens']}")


def save(result: dict[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=4)
    logger.info("Saved the result to %s", path)
