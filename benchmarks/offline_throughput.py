"""Offline throughput on the standard workload: N prompts of IN random token ids, OUT output tokens each
(greedy, ignore_eos), SmolLM2-135M-Instruct by default. The same workload as `shared/bench/peers.sh offline`
runs on vLLM's CPU build, so the two figures compare directly.

    .venv/bin/python benchmarks/offline_throughput.py [--num-prompts 128 --input-len 256 --output-len 128]
        [--dtype bfloat16] [--runs 2] [--profile trace.json] [--engine-arg max_num_seqs=128 ...]

Prints one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import random
import time


def _engine_args(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, value = pair.split("=", 1)
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                continue
        out[key] = {"true": True, "false": False}.get(value, value) if isinstance(value, str) else value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--profile", default=None, help="write a torch profiler trace of one short run here")
    parser.add_argument("--engine-arg", action="append", default=[], help="KEY=VALUE engine argument")
    args = parser.parse_args()

    from pagedllm import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=2048, seed=0, **_engine_args(args.engine_arg))
    rng = random.Random(0)

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(100, 49000) for _ in range(args.input_len)] for _ in range(n)]

    llm.generate(prompts(4), SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0), use_tqdm=False)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    if args.profile:
        import torch

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            llm.generate(prompts(min(args.num_prompts, 64)), SamplingParams(
                max_tokens=16, ignore_eos=True, temperature=0.0), use_tqdm=False)
        prof.export_chrome_trace(args.profile)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    for run in range(args.runs):
        start = time.perf_counter()
        outs = llm.generate(prompts(args.num_prompts), params, use_tqdm=False)
        seconds = time.perf_counter() - start
        n_gen = sum(len(o.outputs[0].token_ids) for o in outs)
        print(json.dumps({"engine": "pagedllm", "run": run, "dtype": args.dtype, "seconds": round(seconds, 2),
                          "output_tok_s": round(n_gen / seconds, 1),
                          "total_tok_s": round((n_gen + args.num_prompts * args.input_len) / seconds, 1)}),
              flush=True)


if __name__ == "__main__":
    main()
