"""The KV offload tier (issue 36) on a cyclic workload whose prefixes overflow the pool: the prefix-hit rate with the
tier against without it, TTFT per hit against recompute, and the hit rate across two DP replicas sharing the tier.

Run: OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/kv_offload.py [--runs 3] [--variants none,tier,dp]
         [--out benchmarks/results/kv_offload.json] [--model PATH]

The workload (the defaults): 64 distinct random 1,024-token prefixes (token ids, so every visit sends exactly the
same tokens), visited in order 0..63, `--cycles` 3 times; each request is a prefix + its own 16 random tokens (a
distinct suffix per visit), 4 output tokens (greedy, ignore_eos), sent one at a time by the benchmarks' client
(`pagedllm.bench.request_func`, streaming /v1/completions). The pool (--num-gpu-blocks-override, block size 16)
holds 8 whole requests, so 8 of the 64 prefixes: least-recently-used eviction on a cycle of 64 keeps none of them
until its next visit, and prefix caching alone hits ~0. The ideal hit count is every prefix token of every visit
but the first of its prefix: (cycles - 1) * 64 * 1,024 tokens.

Variants, each on freshly started servers of the default model (`pagedllm serve`'s SmolLM2-135M GGUF, one thread,
bf16 KV cache; a warm-up request of distinct tokens first, every figure is a difference of /metrics taken around
the workload):
- `none`: no tier (prefix caching only);
- `tier`: `--kv-offloading-size --offload-gib --kv-offloading-backend native`;
- `dp`: the same tier with `--data-parallel-size 2`, PAGEDLLM_DP_ROUTER=round_robin: requests alternate between
  the replicas, and a one-token filler request before every cycle after the first flips the parity, so each prefix
  goes to the other replica than on its previous visit: every hit there is one replica serving what the other
  computed (the filler is left out of the client's figures; it adds a few tokens to /metrics' counts).
Per run and variant: the client's hit rate (usage.prompt_tokens_details.cached_tokens, --enable-prompt-tokens-
details, over prompt tokens) and its ratio to the ideal; the hit rate from /metrics (vllm:prefix_cache_* plus the
connector's vllm:external_prefix_cache_*), and every other /metrics counter named *offload*; TTFT medians of the
visits after the first (hits with a tier, recompute without) and of the first visits (misses); how many greedy
outputs equal the `none` run's. The summary is the median over --runs, variants interleaved within each run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "reliability"), str(ROOT / "tests")]
from reliability_utils import MODEL_NAME, Server  # noqa: E402

from pagedllm.bench.request_func import RequestFuncInput, RequestFuncOutput, request_openai_completions  # noqa: E402

BLOCK_SIZE = 16
TOKEN_RANGE = (1000, 40000)
"""Random prompt tokens are drawn from here: ordinary vocabulary entries of SmolLM2 (49,152 ids; the special
tokens sit at the bottom)."""
VARIANTS = ("none", "tier", "dp", "dp-none")


def request_blocks(args: argparse.Namespace) -> int:
    return -(-(args.prefix_len + args.suffix_len + args.output_len) // BLOCK_SIZE)


def pool_blocks(args: argparse.Namespace) -> int:
    """The pool holds `--pool-prefixes` whole requests (prefix, suffix and output blocks)."""
    return args.pool_prefixes * request_blocks(args)


def workload(args: argparse.Namespace, seed: int) -> tuple[list[tuple[int, int, list[int]]], list[int]]:
    """The requests in order, as (cycle, prefix index, prompt token ids), and the warm-up prompt."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]

    prefixes = [tokens(args.prefix_len) for _ in range(args.num_prefixes)]
    requests = [(cycle, i, prefixes[i] + tokens(args.suffix_len))
                for cycle in range(args.cycles) for i in range(args.num_prefixes)]
    return requests, tokens(args.prefix_len + args.suffix_len)


def server_flags(variant: str, args: argparse.Namespace) -> list[str]:
    flags = ["--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(pool_blocks(args)),
             "--kv-cache-dtype", args.kv_cache_dtype, "--enable-prompt-tokens-details",
             "--max-model-len", str(args.prefix_len + args.suffix_len + args.output_len + 64)]
    if variant.startswith("dp"):
        flags += ["--data-parallel-size", "2"]
    if variant in ("tier", "dp"):
        flags += ["--kv-offloading-size", str(args.offload_gib), "--kv-offloading-backend", "native",
                  *args.tier_args.split()]
    return flags


async def send(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
               request_id: str) -> RequestFuncOutput:
    inp = RequestFuncInput(prompt=prompt, api_url=url, prompt_len=len(prompt), output_len=max_tokens,
                           model=MODEL_NAME, ignore_eos=True, extra_body={"temperature": 0.0}, request_id=request_id)
    out = await request_openai_completions(inp, session)
    if not out.success:
        raise RuntimeError(f"request {request_id} failed: {out.error}")
    return out


async def drive(url: str, requests: list, warmup: list[int], args: argparse.Namespace, flip: bool,
                between=None) -> list[dict]:
    """Send the warm-up, then `between()` (the /metrics before), then the requests one at a time."""
    api = url + "/v1/completions"
    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await send(session, api, warmup, args.output_len, "warmup")
        if between is not None:
            between()
        for k, (cycle, prefix, prompt) in enumerate(requests):
            if flip and cycle > 0 and prefix == 0:
                await send(session, api, [TOKEN_RANGE[0] + cycle], 1, f"filler-{cycle}")
            out = await send(session, api, prompt, args.output_len, f"c{cycle}-p{prefix}-{k}")
            rows.append({"cycle": cycle, "prefix": prefix, "ttft": out.ttft, "cached": out.cached_tokens,
                         "prompt_len": out.prompt_len, "text": out.generated_text,
                         "replica": (prefix + cycle) % 2 if flip else None})
    return rows


def counters(server: Server) -> dict[str, float]:
    """The prefix-cache and connector counters of /metrics, summed over label sets (by name), and by each value
    of their engine, transfer_type and tier labels (`name[label=value]`)."""
    out: dict[str, float] = {}
    for sample, value in server.metrics().items():
        name = sample.split("{", 1)[0]
        if name.endswith("_created") or not ("prefix_cache" in name or "offload" in name or "external" in name):
            continue
        if name.startswith("vllm:cache_config_info"):
            continue
        out[name] = out.get(name, 0.0) + value
        for label in ("engine", "transfer_type", "tier"):
            if f'{label}="' in sample:
                value_of_label = sample.split(f'{label}="', 1)[1].split('"', 1)[0]
                key = f"{name}[{label}={value_of_label}]"
                out[key] = out.get(key, 0.0) + value
    return out


def run_variant(variant: str, run: int, folder: Path, args: argparse.Namespace, reference: list[str] | None) -> dict:
    requests, warmup = workload(args, seed=run)
    env = {"PAGEDLLM_DP_ROUTER": "round_robin"} if variant.startswith("dp") else None
    load_start = os.getloadavg()
    started = time.monotonic()
    server = Server(args.model, folder / f"{variant}-{run}.log", *server_flags(variant, args), env=env)
    try:
        before: dict[str, float] = {}
        rows = asyncio.run(drive(server.url, requests, warmup, args, flip=variant.startswith("dp"),
                                 between=lambda: before.update(counters(server))))
        after = counters(server)
        free = server.kv()
    finally:
        server.close()
    delta = {k: after[k] - before.get(k, 0.0) for k in sorted(after)}
    aligned = args.prefix_len // BLOCK_SIZE * BLOCK_SIZE
    ideal = (args.cycles - 1) * args.num_prefixes * aligned
    prompt_tokens = sum(r["prompt_len"] for r in rows)
    hits = sum(r["cached"] or 0 for r in rows)
    later = [r for r in rows if r["cycle"] > 0]
    first = [r for r in rows if r["cycle"] == 0]
    queries = delta.get("vllm:prefix_cache_queries_total", 0.0)
    local_hits = delta.get("vllm:prefix_cache_hits_total", 0.0)
    external_hits = delta.get("vllm:external_prefix_cache_hits_total", 0.0)
    texts = [r["text"] for r in rows]
    result = {
        "variant": variant, "run": run, "requests": len(rows), "pool_blocks": pool_blocks(args),
        "client_hit_tokens": hits, "ideal_hit_tokens": ideal, "prompt_tokens": prompt_tokens,
        "client_hit_rate": hits / prompt_tokens, "ideal_hit_rate": ideal / prompt_tokens,
        "hit_over_ideal": hits / ideal if ideal else None,
        "later_visits_full_hit": sum((r["cached"] or 0) >= aligned for r in later) / max(len(later), 1),
        "metrics_hit_rate": (local_hits + external_hits) / queries if queries else None,
        "metrics_local_hit_rate": local_hits / queries if queries else None,
        "metrics_external_hit_rate": external_hits / queries if queries else None,
        "ttft_later_median_ms": 1000 * statistics.median(r["ttft"] for r in later) if later else None,
        "ttft_first_median_ms": 1000 * statistics.median(r["ttft"] for r in first),
        "outputs_equal_to_none": (sum(a == b for a, b in zip(texts, reference, strict=True))
                                  if reference is not None else None),
        "metrics_delta": delta, "pool_free_after": [free["num_free_blocks"], free["num_total_blocks"]],
        "seconds": time.monotonic() - started, "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
    }
    if variant.startswith("dp"):
        per = [[r for r in later if r["replica"] == rep] for rep in (0, 1)]
        result["client_hit_over_ideal_per_replica"] = [
            sum(r["cached"] or 0 for r in rs) / (len(rs) * aligned) if rs else None for rs in per]
    result["texts"] = texts
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="Default: `pagedllm serve`'s (SmolLM2-135M).")
    parser.add_argument("--variants", default="none,tier,dp", help=f"Comma-separated, of {', '.join(VARIANTS)}.")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--first-run", type=int, default=0,
                        help="The first run's number (the seed of its prompts): a later sitting continues a series.")
    parser.add_argument("--num-prefixes", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--pool-prefixes", type=int, default=8, help="Whole requests the KV pool holds.")
    parser.add_argument("--kv-cache-dtype", default="bfloat16")
    parser.add_argument("--offload-gib", type=float, default=1.6,
                        help="--kv-offloading-size: SmolLM2's bf16 KV is 360 KiB a block, the workload's distinct "
                             "full blocks (64 x 64 prefix blocks + one suffix block per request) ~1.47 GiB.")
    parser.add_argument("--tier-args", default="", help="More server flags for the tier variants.")
    parser.add_argument("--out", type=Path, default=None, help="Write every row and the summary as JSON here.")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}")
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; pool {pool_blocks(args)} blocks "
          f"({args.pool_prefixes} requests of {request_blocks(args)} blocks)", flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kv-offload-") as tmp:
        for run in range(args.first_run, args.first_run + args.runs):
            reference = None
            for variant in variants:
                row = run_variant(variant, run, Path(tmp), args, reference)
                if variant == "none":
                    reference = row["texts"]
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "texts"}), flush=True)
    summary = summarize(rows, variants)
    print_table(summary)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "cpu": cpu_model(), "summary": summary,
                                        "rows": [{k: v for k, v in r.items() if k != "texts"} for r in rows]},
                                       indent=1) + "\n")


SUMMARY_KEYS = ("client_hit_rate", "ideal_hit_rate", "hit_over_ideal", "later_visits_full_hit", "metrics_hit_rate",
                "metrics_local_hit_rate", "metrics_external_hit_rate", "ttft_later_median_ms",
                "ttft_first_median_ms", "outputs_equal_to_none")


def summarize(rows: list[dict], variants: list[str]) -> dict[str, dict]:
    summary = {}
    for variant in variants:
        mine = [r for r in rows if r["variant"] == variant]
        summary[variant] = {k: (statistics.median(vals) if (vals := [r[k] for r in mine if r[k] is not None])
                                else None) for k in SUMMARY_KEYS}
        summary[variant]["runs"] = len(mine)
        summary[variant]["loadavg_1m"] = statistics.median(r["loadavg_end"][0] for r in mine)
    if "none" in summary and "tier" in summary and summary["tier"]["ttft_later_median_ms"]:
        summary["tier"]["ttft_hit_over_recompute"] = (summary["tier"]["ttft_later_median_ms"]
                                                      / summary["none"]["ttft_later_median_ms"])
    return summary


def print_table(summary: dict[str, dict]) -> None:
    print(f"\n{'variant':<8} {'hit rate':>8} {'ideal':>6} {'/ideal':>6} {'metrics':>7} {'external':>8} "
          f"{'TTFT later ms':>13} {'TTFT first ms':>13} {'same text':>9} {'load':>5}")
    for variant, s in summary.items():
        def fmt(key: str, spec: str, s: dict = s) -> str:
            return "-" if s[key] is None else format(s[key], spec)
        print(f"{variant:<8} {fmt('client_hit_rate', '.3f'):>8} {fmt('ideal_hit_rate', '.3f'):>6} "
              f"{fmt('hit_over_ideal', '.3f'):>6} {fmt('metrics_hit_rate', '.3f'):>7} "
              f"{fmt('metrics_external_hit_rate', '.3f'):>8} {fmt('ttft_later_median_ms', '.1f'):>13} "
              f"{fmt('ttft_first_median_ms', '.1f'):>13} {fmt('outputs_equal_to_none', '.0f'):>9} "
              f"{s['loadavg_1m']:>5.2f}")
    if "tier" in summary and "ttft_hit_over_recompute" in summary["tier"]:
        print(f"TTFT per hit / recompute (medians of the later visits): "
              f"{summary['tier']['ttft_hit_over_recompute']:.3f}")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
