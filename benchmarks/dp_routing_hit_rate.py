"""Prefix-aware routing against round robin at --data-parallel-size 2: the aggregate prefix-cache hit rate, TTFT
and the replicas' share of the requests, on vLLM's prefix-repetition workload with pools that hold about half the
prefixes per replica.

Run: .venv/bin/python benchmarks/dp_routing_hit_rate.py [--model PATH] [--num-prefixes 16] [--prefix-len 256]

For each policy (PAGEDLLM_DP_ROUTER=prefix, then round_robin) it starts `pagedllm serve --data-parallel-size 2`
on a free port (the tiny random Llama of the tests unless --model; one thread per replica), runs
`pagedllm bench serve --dataset-name prefix-repetition` against it, and reads /metrics: prefix-cache hits over
queries summed over both replicas, and the requests each replica finished.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "reliability"), str(ROOT / "tests")]
from reliability_utils import MODEL_NAME, Server  # noqa: E402

from server_process import build_tiny_model  # noqa: E402


def _per_engine(server: Server, name: str) -> list[float]:
    return [server.metric(f'{name}{{engine="{rank}"') for rank in (0, 1)]


def run_policy(policy: str, model: Path, folder: Path, args: argparse.Namespace) -> dict:
    prompt_blocks = (args.prefix_len + args.suffix_len) // 16 + 1
    per_prefix_blocks = args.prefix_len // 16
    # Half the prefixes per replica, plus room for the requests in flight (prompt and output blocks each).
    num_blocks = args.num_prefixes // 2 * per_prefix_blocks + args.concurrency * (prompt_blocks
                                                                                    + args.output_len // 16 + 1)
    server = Server(model, folder / f"{policy}.log", "--data-parallel-size", "2", "--block-size", "16",
                    "--num-gpu-blocks-override", str(num_blocks), "--max-model-len", str(args.max_model_len),
                    env={"PAGEDLLM_DP_ROUTER": policy})
    try:
        result_dir = folder / policy
        subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli.main", "bench", "serve", "--base-url",
                        server.url, "--model", MODEL_NAME, "--tokenizer", str(args.tokenizer or model),
                        "--dataset-name", "prefix-repetition", "--num-prompts", str(args.num_prompts),
                        "--prefix-repetition-prefix-len", str(args.prefix_len),
                        "--prefix-repetition-suffix-len", str(args.suffix_len),
                        "--prefix-repetition-num-prefixes", str(args.num_prefixes),
                        "--prefix-repetition-output-len", str(args.output_len), "--ignore-eos",
                        "--max-concurrency", str(args.concurrency), "--metric-percentiles", "50",
                        "--disable-tqdm", "--save-result", "--result-dir", str(result_dir),
                        "--result-filename", "result.json"], check=True, stdout=subprocess.DEVNULL)
        bench = json.loads((result_dir / "result.json").read_text())
        hits = _per_engine(server, "vllm:prefix_cache_hits_total")
        queries = _per_engine(server, "vllm:prefix_cache_queries_total")
        finished = _per_engine(server, "vllm:request_success_total")
        return {"policy": policy, "blocks_per_replica": num_blocks, "hit_rate": sum(hits) / max(sum(queries), 1),
                "hit_rate_per_replica": [h / max(q, 1) for h, q in zip(hits, queries, strict=True)],
                "requests_per_replica": finished, "median_ttft_ms": bench.get("median_ttft_ms"),
                "output_throughput": bench.get("output_throughput")}
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="Default: the tests' tiny random Llama (GGUF).")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--num-prefixes", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--policies", default="prefix,round_robin")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dp-routing-") as tmp:
        folder = Path(tmp)
        model = args.model or build_tiny_model(folder)
        rows = [run_policy(policy, model, folder, args) for policy in args.policies.split(",")]
    for row in rows:
        print(json.dumps(row))
    if len(rows) == 2 and rows[1]["hit_rate"]:
        print(f"hit rate {rows[0]['policy']} / {rows[1]['policy']}: {rows[0]['hit_rate'] / rows[1]['hit_rate']:.2f}x")


if __name__ == "__main__":
    main()
