"""The data-parallel router's cost per request in the API server (engine/dp_router.py), without a model.

Run: .venv/bin/python benchmarks/dp_router_cost.py [--prompt-len 2048] [--replicas 2] [--repeats 2000]

Each request is routed and then released, as AsyncLLM does: hashing its full blocks (block size 16, SHA-256
chained, as the KV cache manager), matching them against every replica's remembered hashes, choosing, and
remembering them. Three cases: a prompt no replica has seen, one whose whole prompt a replica holds (every block
matches), and one replica only (no hashing at all: the cost at --data-parallel-size 1).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pagedllm.engine.dp_router import DPRouter


def _per_request_us(router: DPRouter, prompts: list[list[int]]) -> float:
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        router.route([str(i)], prompt, None)
        router.release(str(i))
    return (time.perf_counter() - start) / len(prompts) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()
    rng = random.Random(0)
    fresh = [[rng.randrange(32000) for _ in range(args.prompt_len)] for _ in range(args.repeats)]
    seen = fresh[:1] * args.repeats
    capacity = 16384  # blocks per replica: a 4 GiB pool of a small model
    results = {}
    for name, prompts, replicas in (("unseen prompt", fresh, args.replicas), ("fully cached prompt", seen,
                                                                             args.replicas),
                                    ("one replica", fresh, 1)):
        runs = []
        for _ in range(3):
            router = DPRouter(replicas, block_size=16, capacity_blocks=capacity, policy="prefix")
            runs.append(_per_request_us(router, prompts))
        results[name] = statistics.median(runs)
    for name, us in results.items():
        print(f"{name:>20}: {us:8.1f} us per request ({args.prompt_len} tokens, {args.replicas} replicas)")


if __name__ == "__main__":
    main()
