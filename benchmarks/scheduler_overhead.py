"""Scheduler overhead without a model: one decode step for 256 requests, and one prefix-cache lookup.

Run: .venv/bin/python benchmarks/scheduler_overhead.py [--repeats N] [--profile]

1. step: schedule() + update_from_output() with 256 running decode requests, block size 16,
   prefix caching on, about 1,000 tokens of context each (target <= 1.0 ms).
2. lookup: KVCacheManager.get_computed_blocks for a fully cached 4,000-token prompt (target <= 0.5 ms).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.messages import ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 16
NUM_REQS = 256
CONTEXT_LEN = 1000


def make_request(req_id: str, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(req_id, prompt, params, eos_token_id=None, arrival_time=time.time(), block_size=BLOCK_SIZE)


def decode_scheduler(num_steps: int) -> Scheduler:
    """256 requests whose ~1,000-token prompts are already prefilled; they decode from here on."""
    scheduler_config = SchedulerConfig(max_num_seqs=NUM_REQS, max_num_batched_tokens=2 * CONTEXT_LEN * NUM_REQS)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    # The prefill takes up to ~NUM_REQS / 4 steps, in which the requests prefilled first already decode.
    max_tokens = num_steps + NUM_REQS
    num_blocks = NUM_REQS * (CONTEXT_LEN + max_tokens + 64) // BLOCK_SIZE + 1
    scheduler = Scheduler(scheduler_config, cache_config, num_blocks, max_model_len=4096)
    for i in range(NUM_REQS):
        prompt = [(i * 7919 + j) % 32000 for j in range(CONTEXT_LEN - 7 + i % 16)]
        scheduler.add_request(make_request(f"req-{i}", prompt, max_tokens=max_tokens))
    # Prefill: max_prefill_attention_pairs splits it over several steps.
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running + list(scheduler.waiting)):
        output = scheduler.schedule()
        scheduler.update_from_output(output, sample(output, 0))
    return scheduler


def sample(output, token_id: int) -> ModelRunnerOutput:
    req_ids = list(output.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[token_id]] * len(req_ids))


def bench_step(repeats: int, profile: bool) -> tuple[float, float]:
    scheduler = decode_scheduler(repeats)
    # Build runner outputs outside the timed region: they are the runner's work, not the scheduler's.
    times, cpu_times = [], []
    profiler = cProfile.Profile() if profile else None
    for i in range(repeats):
        req_ids = [r.request_id for r in scheduler.running]
        runner_output = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[i % 32000]] * len(req_ids))
        if profiler:
            profiler.enable()
        c0, t0 = time.thread_time(), time.perf_counter()
        output = scheduler.schedule()
        scheduler.update_from_output(output, runner_output)
        t1, c1 = time.perf_counter(), time.thread_time()
        if profiler:
            profiler.disable()
        if output.total_num_scheduled_tokens != NUM_REQS:
            raise RuntimeError(f"expected {NUM_REQS} decode tokens, got {output.total_num_scheduled_tokens}")
        times.append(t1 - t0)
        cpu_times.append(c1 - c0)
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    return statistics.median(times), statistics.median(cpu_times)


def bench_lookup(repeats: int) -> float:
    scheduler_config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8192)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    scheduler = Scheduler(scheduler_config, cache_config, num_blocks=1024, max_model_len=8192)
    prompt = [(j * 31) % 32000 for j in range(4000)]
    first = make_request("first", prompt, max_tokens=1)
    scheduler.add_request(first)
    while not first.is_finished:  # a few prefill steps (max_prefill_attention_pairs), then its one token
        output = scheduler.schedule()
        scheduler.update_from_output(output, sample(output, 1))  # its blocks stay cached
    kv = scheduler.kv_cache_manager
    probe = make_request("probe", prompt, max_tokens=1)
    blocks, num_hit = kv.get_computed_blocks(probe)
    if num_hit != (4000 - 1) // BLOCK_SIZE * BLOCK_SIZE:
        raise RuntimeError(f"expected a full hit, got {num_hit} tokens")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        kv.get_computed_blocks(probe)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_hashing(repeats: int) -> float:
    prompt = [(j * 31) % 32000 for j in range(4000)]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        make_request("h", prompt, max_tokens=1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=500)
    parser.add_argument("--profile", action="store_true", help="cProfile the decode steps")
    args = parser.parse_args()
    step, step_cpu = bench_step(args.repeats, args.profile)
    lookup = bench_lookup(args.repeats)
    hashing = bench_hashing(min(args.repeats, 100))
    print(f"schedule()+update_from_output(), {NUM_REQS} decode reqs, ~{CONTEXT_LEN} ctx, block {BLOCK_SIZE}: "
          f"median {step * 1e3:.3f} ms wall, {step_cpu * 1e3:.3f} ms thread CPU (target <= 1.0 ms)")
    print(f"get_computed_blocks(), fully cached 4000-token prompt: median {lookup * 1e3:.3f} ms "
          f"(target <= 0.5 ms)")
    print(f"Request() incl. hashing 250 blocks of a 4000-token prompt: median {hashing * 1e3:.3f} ms (info)")


if __name__ == "__main__":
    main()
