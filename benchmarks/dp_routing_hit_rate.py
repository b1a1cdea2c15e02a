"""Prefix-aware routing against round robin, on issue 16's workload: the aggregate prefix-cache hit rate, TTFT p50
and the replicas' share of the requests, with pools that hold about half the prefixes per replica.

Run: OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/dp_routing_hit_rate.py \
         [--frontends dp,vllm-router] [--out benchmarks/results/scale_out/routing.json] [--model PATH]

The workload (the defaults): vLLM's `prefix-repetition` dataset, 16 random 1,024-token system prompts shared by 8
users each (128 requests, each its own 32-token suffix, 8 output tokens, ignore_eos), shuffled, sent by
`pagedllm bench serve` at concurrency 4. Each replica's pool (--num-gpu-blocks-override) holds half the prefixes
plus the suffix and output blocks of the requests in flight.

Two frontends, each policy on freshly started servers (the tiny random Llama of the tests, with a 2,048-token
context, unless --model; one thread per process):
- `dp`: `pagedllm serve --data-parallel-size 2`, PAGEDLLM_DP_ROUTER=prefix, then round_robin;
- `vllm-router`: two `pagedllm serve` processes behind `vllm-router --policy cache_aware`, then round_robin (the
  router of tests/entrypoints/test_vllm_router.py); the hit rates come from each server's /metrics.
Per policy: hits over queries summed over both replicas, TTFT p50 (bench serve), the requests each replica finished
and their max/min; per frontend: the hit-rate ratio and the TTFT p50 ratio of the two policies.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "reliability"), str(ROOT / "tests" / "entrypoints"), str(ROOT / "tests")]
from reliability_utils import MODEL_NAME, Server  # noqa: E402

from server_process import build_tiny_model  # noqa: E402

POLICIES = {"dp": ("prefix", "round_robin"), "vllm-router": ("cache_aware", "round_robin")}


def pool_blocks(args: argparse.Namespace) -> int:
    """Half the prefixes per replica, plus the blocks of their own (suffix and output, and the block a prefix
    shares with its suffix) of the requests in flight: a request in flight holds its prefix's blocks, so room for
    whole prompts would let the pool keep several more prefixes."""
    return (args.num_prefixes // 2 * (args.prefix_len // 16)
            + args.concurrency * ((args.suffix_len + args.output_len) // 16 + 2))


def server_flags(args: argparse.Namespace) -> tuple[str, ...]:
    max_model_len = args.prefix_len + args.suffix_len + args.output_len + 16  # a retokenized prompt may grow a little
    return ("--block-size", "16", "--num-gpu-blocks-override", str(pool_blocks(args)), "--max-model-len",
            str(max_model_len))


def bench(base_url: str, model: Path, result_dir: Path, args: argparse.Namespace) -> dict:
    subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli.main", "bench", "serve", "--base-url", base_url,
                    "--model", MODEL_NAME, "--tokenizer", str(args.tokenizer or model),
                    "--dataset-name", "prefix-repetition", "--num-prompts", str(args.num_prompts),
                    "--prefix-repetition-prefix-len", str(args.prefix_len),
                    "--prefix-repetition-suffix-len", str(args.suffix_len),
                    "--prefix-repetition-num-prefixes", str(args.num_prefixes),
                    "--prefix-repetition-output-len", str(args.output_len), "--ignore-eos",
                    "--max-concurrency", str(args.concurrency), "--metric-percentiles", "50",
                    "--disable-tqdm", "--save-result", "--result-dir", str(result_dir),
                    "--result-filename", "result.json"], check=True, stdout=subprocess.DEVNULL)
    return json.loads((result_dir / "result.json").read_text())


def row(frontend: str, policy: str, hits: list[float], queries: list[float], finished: list[float], result: dict,
        args: argparse.Namespace) -> dict:
    return {"frontend": frontend, "policy": policy, "blocks_per_replica": pool_blocks(args),
            "hit_rate": sum(hits) / max(sum(queries), 1),
            "hit_rate_per_replica": [h / max(q, 1) for h, q in zip(hits, queries, strict=True)],
            "requests_per_replica": finished, "load_max_over_min": max(finished) / max(min(finished), 1),
            "median_ttft_ms": result.get("median_ttft_ms"), "output_throughput": result.get("output_throughput"),
            "completed": result.get("completed"),
            **({"router_args": args.router_args} if frontend == "vllm-router" and args.router_args else {})}


def run_dp(policy: str, model: Path, folder: Path, args: argparse.Namespace) -> dict:
    server = Server(model, folder / f"dp-{policy}.log", "--data-parallel-size", "2", *server_flags(args),
                    env={"PAGEDLLM_DP_ROUTER": policy})
    try:
        result = bench(server.url, model, folder / f"dp-{policy}", args)

        def per_engine(name: str) -> list[float]:
            return [server.metric(f'{name}{{engine="{rank}"') for rank in (0, 1)]

        return row("dp", policy, per_engine("vllm:prefix_cache_hits_total"),
                   per_engine("vllm:prefix_cache_queries_total"), per_engine("vllm:request_success_total"), result,
                   args)
    finally:
        server.close()


def run_vllm_router(policy: str, model: Path, folder: Path, args: argparse.Namespace) -> dict:
    from test_vllm_router import ROUTER, router

    if ROUTER is None:
        raise SystemExit("vllm-router is not installed (the test extra)")
    servers = [Server(model, folder / f"router-{policy}-{i}.log", *server_flags(args), wait_ready=False)
               for i in range(2)]
    try:
        for server in servers:
            server.wait_ready()
        with router(policy, servers, *args.router_args.split()) as client:
            result = bench(str(client.base_url).rstrip("/").removesuffix("/v1"), model, folder / f"router-{policy}",
                           args)
        return row("vllm-router", policy, [s.metric("vllm:prefix_cache_hits_total") for s in servers],
                   [s.metric("vllm:prefix_cache_queries_total") for s in servers],
                   [s.metric("vllm:request_success_total") for s in servers], result, args)
    finally:
        for server in servers:
            server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="Default: the tests' tiny random Llama (GGUF) with a 2,048-token context.")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--frontends", default="dp,vllm-router")
    parser.add_argument("--num-prefixes", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="Write the rows and ratios as JSON here.")
    parser.add_argument("--router-args", default="",
                        help="More vllm-router flags, e.g. '--balance-abs-threshold 1' (its default, 64, never "
                             "rebalances at a concurrency of 4)")
    args = parser.parse_args()
    runners = {"dp": run_dp, "vllm-router": run_vllm_router}
    rows, summaries = [], []
    with tempfile.TemporaryDirectory(prefix="dp-routing-") as tmp:
        folder = Path(tmp)
        model = args.model or build_tiny_model(folder, max_position_embeddings=2048)
        for frontend in args.frontends.split(","):
            aware, blind = (runners[frontend](policy, model, folder, args) for policy in POLICIES[frontend])
            rows += [aware, blind]
            summary = {"frontend": frontend, "policies": [aware["policy"], blind["policy"]],
                       "hit_rate_ratio": aware["hit_rate"] / blind["hit_rate"] if blind["hit_rate"] else None,
                       "ttft_p50_ratio": (aware["median_ttft_ms"] / blind["median_ttft_ms"]
                                          if blind["median_ttft_ms"] else None)}
            summaries.append(summary)
            for r in (aware, blind):
                print(json.dumps(r), flush=True)
            print(json.dumps(summary), flush=True)
    print(f"\n{'frontend':<12} {'policy':<12} {'hit rate':>8} {'TTFT p50 ms':>11} {'requests per replica':>21} "
          f"{'max/min':>7}")
    for r in rows:
        print(f"{r['frontend']:<12} {r['policy']:<12} {r['hit_rate']:>8.3f} {r['median_ttft_ms']:>11.1f} "
              f"{str([int(n) for n in r['requests_per_replica']]):>21} {r['load_max_over_min']:>7.2f}")
    for s in summaries:
        print(f"{s['frontend']}: hit rate {s['policies'][0]} / {s['policies'][1]} = {s['hit_rate_ratio']:.2f}x, "
              f"TTFT p50 ratio {s['ttft_p50_ratio']:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        workload = {k: getattr(args, k) for k in ("num_prefixes", "prefix_len", "suffix_len", "num_prompts",
                                                  "output_len", "concurrency")}
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "workload": workload,
                                        "blocks_per_replica": pool_blocks(args), "rows": rows,
                                        "summaries": summaries}, indent=1) + "\n")


if __name__ == "__main__":
    main()
