"""What the KV offload tier costs when nothing is reused, and what a hit saves, offline on SmolLM2-135M.

Three engines, made once and used in turn run by run (interleaved): no tier, the tier with its saves on a
background thread (async_save true, the default), and with its saves inside the step (async_save false).
- "miss": fresh random prompts every run (no prefix-cache nor tier hit): the time of generate() shows what the
  write-through saves cost the step;
- "reuse": the same prompts twice with a pool that holds two of them: the second pass loads every full block from
  the tier (the engines with a tier) or recomputes it (no tier).

    PYTHONPATH=src python benchmarks/kv_offload_save.py [--runs 5] [--prompts 8] [--prompt-len 512]
Prints medians (and ranges) per variant and the load average before and after.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import uuid

from pagedllm import LLM, SamplingParams


def _engine(tier: str | None, max_len: int) -> LLM:
    """A pool of two requests of max_len tokens (and a block to spare)."""
    kwargs = {"num_gpu_blocks_override": 2 * max_len // 16 + 1, "max_model_len": max_len, "max_num_seqs": 4}
    if tier is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30, "shm_name": f"bench-{uuid.uuid4().hex}",
                                          "async_save": tier == "async"}}
    return LLM(**kwargs)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    max_len = -(-(args.prompt_len + args.max_tokens) // 16) * 16
    variants = {"off": None, "async": "async", "sync": "sync"}
    engines = {name: _engine(tier, max_len) for name, tier in variants.items()}
    rng = random.Random(0)
    for llm in engines.values():  # warm-up: native kernels (prefill after a hit too), allocator, the tier's pages
        warm = [[rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(4)]
        _run(llm, warm, params)
        _run(llm, warm, params)
    print(f"load before: {_loadavg()}; {args.prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} out, "
          f"pool {2 * max_len // 16 + 1} blocks", flush=True)
    times: dict[str, dict[str, list[float]]] = {name: {"miss": [], "first": [], "reuse": []} for name in variants}
    for run in range(args.runs):
        order = list(variants) if run % 2 == 0 else list(reversed(variants))
        for name in order:
            fresh = [[rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
            times[name]["miss"].append(_run(engines[name], fresh, params))
        for name in order:
            shared = [[rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
            times[name]["first"].append(_run(engines[name], shared, params))
            times[name]["reuse"].append(_run(engines[name], shared, params))
        print(f"run {run}: " + ", ".join(f"{name} miss {times[name]['miss'][-1]:.2f} reuse "
                                         f"{times[name]['reuse'][-1]:.2f}" for name in variants)
              + f" (load {_loadavg()})", flush=True)
    print(f"load after: {_loadavg()}")
    for kind in ("miss", "reuse"):
        base = statistics.median(times["off"][kind])
        for name in variants:
            series = times[name][kind]
            median = statistics.median(series)
            print(f"{kind:5s} {name:5s} median {median:6.2f} s (range {min(series):.2f}-{max(series):.2f}) "
                  f"= {median / base:.2f}x off")
    for name, llm in engines.items():
        kv_transfer = llm.llm_engine.engine_core.scheduler.kv_transfer
        if kv_transfer is not None:
            print(name, {k: round(v, 3) for k, v in kv_transfer.connector.get_stats().items()},
                  "external hits", kv_transfer.external_hits)
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
