"""One long prompt against a streaming neighbour (issue 17, item 2): does /health stay 200, and how long does
the neighbour's stream stall while the long prompt's prefill runs?

    .venv/bin/python benchmarks/long_prompt_stall.py [--prompt-tokens 7000] [--url URL] [-- EXTRA SERVE FLAGS]

Starts `pagedllm serve` (the embedded SmolLM2-135M-Instruct) unless `--url` names a running server, starts one
streaming request (`--stream-tokens` tokens, ignore_eos), then sends one prompt of `--prompt-tokens` random
token ids (max_tokens 1) while GET /health is polled every 0.5 s. Prints the neighbour's worst inter-token gap
during the long prefill, the /health answers (count of 200 and of anything else, with the slowest answer), and
the long request's latency; `--result-file` writes them as JSON. The neighbour is cancelled once the long
request has finished.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "reliability"), str(ROOT / "tests")]
from reliability_utils import Server  # noqa: E402


async def measure(url: str, prompt_tokens: int, stream_tokens: int, model: str) -> dict:
    rng = random.Random(0)
    long_prompt = [rng.randrange(1000, 40000) for _ in range(prompt_tokens)]
    gaps: list[tuple[float, float]] = []  # (arrival time, gap since the previous chunk)
    health: list[tuple[int, float]] = []
    done = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as client:

        async def neighbour() -> None:
            body = {"model": model, "prompt": "Once upon a time", "max_tokens": stream_tokens, "ignore_eos": True,
                    "stream": True, "temperature": 0.0}
            last = None
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        now = time.monotonic()
                        if last is not None:
                            gaps.append((now, now - last))
                        last = now

        async def poll_health() -> None:
            while not done.is_set():
                start = time.monotonic()
                try:
                    status = (await client.get("/health", timeout=30.0)).status_code
                except httpx.HTTPError:
                    status = 0
                health.append((status, time.monotonic() - start))
                await asyncio.sleep(max(0.0, 0.5 - (time.monotonic() - start)))

        stream_task = asyncio.create_task(neighbour())
        await asyncio.sleep(2.0)  # the neighbour is decoding
        health_task = asyncio.create_task(poll_health())
        start = time.monotonic()
        response = await client.post("/v1/completions", json={"model": model, "prompt": long_prompt, "max_tokens": 1})
        long_end = time.monotonic()
        await asyncio.sleep(1.0)  # the neighbour's first gap after the prefill counts too
        done.set()
        await health_task
        stream_task.cancel()
        await asyncio.gather(stream_task, return_exceptions=True)
    during = [gap for at, gap in gaps if start <= at <= long_end + 1.0]
    return {"prompt_tokens": prompt_tokens, "long_status": response.status_code, "long_latency_s": long_end - start,
            "worst_gap_s": max(during, default=0.0), "num_gaps_over_2s": sum(g > 2.0 for g in during),
            "health_200": sum(s == 200 for s, _ in health), "health_other": sum(s != 200 for s, _ in health),
            "health_statuses": sorted({s for s, _ in health}), "slowest_health_s": max(d for _, d in health)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url")
    parser.add_argument("--prompt-tokens", type=int, default=7000)
    parser.add_argument("--stream-tokens", type=int, default=2000)
    parser.add_argument("--result-file")
    parser.add_argument("serve_args", nargs="*")
    args = parser.parse_args()
    server = None
    url, model = args.url, "tiny"
    if url is None:
        log = Path(tempfile.mkdtemp(prefix="long-prompt-")) / "server.log"
        server = Server(None, log, "--kv-cache-memory", "1GiB", *args.serve_args, env={"OMP_NUM_THREADS": "2"})
        url = server.url
        print(f"server log: {log}")
    else:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    try:
        result = asyncio.run(measure(url, args.prompt_tokens, args.stream_tokens, model))
    finally:
        if server is not None:
            server.close()
    print(json.dumps(result, indent=1))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
