"""Output tokens/s with every request constrained by a JSON schema against the same requests unconstrained, at
concurrency 1 and 16 (targets: constrained >= 95% of unconstrained at c1, >= 90% at c16). Needs a quiet machine:
the two modes alternate round by round and the ratio is of the medians.

Both modes produce exactly --max-tokens tokens per request: the unconstrained requests ignore EOS, and the schema
(an array of at least 40 small objects) cannot end sooner, so the comparison is per token of the same length.

    python benchmarks/structured_outputs_throughput.py                      # starts `pagedllm serve` (SmolLM2)
    python benchmarks/structured_outputs_throughput.py --base-url http://127.0.0.1:8000 --model NAME
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_process import free_port, wait_healthy  # noqa: E402

SCHEMA = {"type": "array", "minItems": 40, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120},
                   "city": {"type": "string", "maxLength": 16}}}}


async def _one(client: httpx.AsyncClient, model: str, index: int, constrained: bool, max_tokens: int) -> int:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
            "messages": [{"role": "user", "content": f"List {40 + index % 7} people (request {index}) as JSON."}]}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    response = await client.post("/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"]


async def _round(base_url: str, model: str, concurrency: int, num_requests: int, constrained: bool,
                 max_tokens: int, offset: int) -> float:
    """Output tokens/s of num_requests requests sent concurrency at a time."""
    queue = list(range(offset, offset + num_requests))
    total = 0

    async with httpx.AsyncClient(base_url=base_url, timeout=600.0) as client:
        async def worker() -> None:
            nonlocal total
            while queue:
                total += await _one(client, model, queue.pop(), constrained, max_tokens)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return total / (time.perf_counter() - start)


def measure(base_url: str, model: str, concurrencies: list[int], rounds: int, max_tokens: int) -> None:
    asyncio.run(_round(base_url, model, 2, 4, True, 16, 10**6))  # warm-up: compile, first allocations
    print("| concurrency | unconstrained tok/s | constrained tok/s | constrained / unconstrained | target |")
    print("| --- | --- | --- | --- | --- |")
    for concurrency in concurrencies:
        num_requests = max(4, 2 * concurrency)
        rates: dict[bool, list[float]] = {False: [], True: []}
        for r in range(rounds):
            for constrained in ((False, True) if r % 2 == 0 else (True, False)):
                offset = (2 * r + constrained) * num_requests  # distinct prompts: no prefix-cache advantage
                rates[constrained].append(asyncio.run(_round(base_url, model, concurrency, num_requests,
                                                             constrained, max_tokens, offset)))
        plain, constrained = statistics.median(rates[False]), statistics.median(rates[True])
        target = "95%" if concurrency == 1 else "90%"
        print(f"| {concurrency} | {plain:.1f} | {constrained:.1f} | {100 * constrained / plain:.1f}% | {target} |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None, help="a running server (default: start `pagedllm serve`)")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="the served model name")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per mode (alternating)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--serve-args", default="", help="extra `pagedllm serve` flags")
    args = parser.parse_args()
    if args.base_url:
        measure(args.base_url, args.model, args.concurrency, args.rounds, args.max_tokens)
        return
    port = free_port()
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", "--port", str(port),
               "--served-model-name", args.model, "--disable-log-requests", *args.serve_args.split()]
    proc = subprocess.Popen(command)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, timeout_s=300)
        measure(url, args.model, args.concurrency, args.rounds, args.max_tokens)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
