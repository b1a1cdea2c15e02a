"""Decode step time at a fixed batch: B requests with P-token prompts, prefilled, then timed decode steps
(greedy, ignore_eos), plus a torch-profiler table of a few steps. The decode-heavy half of the standard
workload (batch 64, ~320 tokens of context) by default.

    .venv/bin/python benchmarks/decode_step.py [--batch 64 --prompt-len 304 --steps 32] [--dtype float32]
        [--threads N] [--profile-steps 4] [--kv-cache-memory BYTES] [--kv-cache-dtype fp8 [--no-calculate-kv-scales]]
        [--tensor-parallel-size N] [--distributed-executor-backend uni|mp]

Prints one JSON line: median / min / max ms per decode step, tokens per second at that batch, and the median
process CPU time per step (all threads; on a shared machine it moves less with other jobs than wall time does;
with the mp executor it counts only the engine process, not the workers), and the engine's start-up time (load_s:
LLM() to ready; with mp, the workers' fresh interpreters and model loads included).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=304)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before running")
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache (default: the engine's)")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--calculate-kv-scales", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--profile-steps", type=int, default=0, help="profile this many extra decode steps")
    parser.add_argument("--tensor-parallel-size", type=int, default=None, help="ranks (mp: 1 process each); with "
                        "--threads unset each rank gets this process's threads / size")
    parser.add_argument("--distributed-executor-backend", default=None)
    args = parser.parse_args()

    import torch

    from pagedllm import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    parallel = {k: v for k, v in (("tensor_parallel_size", args.tensor_parallel_size),
                                  ("distributed_executor_backend", args.distributed_executor_backend)) if v}
    load_start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=2048, seed=0, max_num_seqs=max(args.batch, 1),
              max_num_batched_tokens=8192, kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
              calculate_kv_scales=args.calculate_kv_scales, **parallel)
    load_s = time.perf_counter() - load_start
    engine = llm.llm_engine
    rng = random.Random(0)
    total = args.steps + args.profile_steps + 4
    params = SamplingParams(max_tokens=total, ignore_eos=True, temperature=0.0)
    top = min(49000, engine.engine_core.model_info.vocab_size)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [rng.randrange(100, top) for _ in range(args.prompt_len)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.engine_core.scheduler.running) \
            or engine.engine_core.scheduler.waiting:
        engine.step()
    for _ in range(2):  # warm-up decode steps
        engine.step()
    times, cpu_times = [], []
    for _ in range(args.steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        engine.step()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    if args.profile_steps:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.profile_steps):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    if parallel:
        engine.engine_core.shutdown()  # the mp executor's workers
    median = statistics.median(times)
    print(json.dumps({"batch": args.batch, "context": args.prompt_len, "dtype": args.dtype,
                      "kv_cache_dtype": args.kv_cache_dtype, "calculate_kv_scales": args.calculate_kv_scales,
                      "threads": torch.get_num_threads(), "step_ms_median": round(median * 1e3, 1),
                      "step_ms_min": round(min(times) * 1e3, 1), "step_ms_max": round(max(times) * 1e3, 1),
                      "cpu_ms_median": round(statistics.median(cpu_times) * 1e3, 1),
                      "tok_s": round(args.batch / median, 1), "load_s": round(load_s, 1), **parallel,
                      "load": " ".join(open("/proc/loadavg").read().split()[:3])}), flush=True)


if __name__ == "__main__":
    main()
