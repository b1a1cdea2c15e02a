"""A two-token completion while a big /tokenize is in flight (issue 32, item 4): how long does it wait?

    .venv/bin/python benchmarks/api_server_isolation.py [--runs 5] [--src PATH] [--url URL] [--result-file F]
        [-- EXTRA SERVE FLAGS]

Starts `pagedllm serve` (the embedded SmolLM2-135M-Instruct, a 512 MiB KV pool: one 8,192-token request) unless
`--url` names a running server. `--src PATH` puts PATH (a checkout's `src`) first on the server's PYTHONPATH, to
measure another version of the code, e.g. main in a temporary `git worktree`. Three scenarios, `--runs` times each:

- idle: the completion alone;
- huge: a 13.8 MB /tokenize (what the issue sent; over the prompt cap), the completion sent 1 s after it;
- largest: the longest text under the prompt cap (max_model_len x the longest token's characters x 2, as
  serving_base.max_prompt_chars), the completion sent 0.2 s after it.

The completion: "Hello", max_tokens 2, temperature 0. Prints the median and worst completion latency per scenario,
with the /tokenize's status and duration (a completion that ends after the /tokenize shows it waited for it);
`--result-file` writes every sample as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "reliability"), str(ROOT / "tests")]
from reliability_utils import Server  # noqa: E402

HUGE_CHARS = 13_800_000
SCENARIOS = {"idle": (0, 0.0), "huge": (HUGE_CHARS, 1.0), "largest": (None, 0.2)}
"""name: (text characters (None: the cap), seconds between the /tokenize and the completion)."""


def prompt_cap(max_model_len: int) -> int:
    from pagedllm.entrypoints.openai.serving_base import max_prompt_chars
    from pagedllm.tokenizer import get_tokenizer

    return max_prompt_chars(max_model_len, get_tokenizer(None))


async def one_run(client: httpx.AsyncClient, model: str, text: str, delay_s: float) -> dict:
    """Returns the completion's latency and end time, and the /tokenize's status, duration and end time."""
    sample: dict = {}
    start = time.monotonic()

    async def tokenize() -> None:
        response = await client.post("/tokenize", json={"model": model, "prompt": text})
        sample.update(tokenize_status=response.status_code, tokenize_s=time.monotonic() - start,
                      tokenize_end=time.monotonic())

    task = asyncio.create_task(tokenize()) if text else None
    await asyncio.sleep(delay_s)
    sent = time.monotonic()
    response = await client.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 2,
                                                          "temperature": 0.0})
    sample.update(completion_status=response.status_code, completion_s=time.monotonic() - sent,
                  completion_end=time.monotonic())
    if task is not None:
        await task
        sample["completion_first"] = sample["completion_end"] < sample["tokenize_end"]
    return sample


async def measure(url: str, runs: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as client:
        card = (await client.get("/v1/models")).json()["data"][0]
        cap = prompt_cap(card["max_model_len"])
        results: dict = {"max_model_len": card["max_model_len"], "cap_chars": cap}
        for name, (chars, delay_s) in SCENARIOS.items():
            chars = cap if chars is None else chars
            text = ("hello world " * (chars // 12 + 1))[:chars]
            await one_run(client, card["id"], "", 0.0)  # warm
            samples = [await one_run(client, card["id"], text, delay_s) for _ in range(runs)]
            latencies = [s["completion_s"] for s in samples]
            results[name] = {"chars": chars, "samples": samples, "completion_median_s": statistics.median(latencies),
                             "completion_max_s": max(latencies)}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--src", help="a checkout's src folder for the server to run (default: this one)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--result-file")
    parser.add_argument("serve_args", nargs="*", help="after --: extra `pagedllm serve` flags")
    args = parser.parse_args()
    server = None
    if args.url is None:
        log = Path(tempfile.mkdtemp()) / "server.log"
        env = {"PYTHONPATH": str(Path(args.src).resolve())} if args.src else None
        server = Server(None, log, "--max-num-seqs", "8", "--kv-cache-memory", "512MiB", *args.serve_args, env=env)
    try:
        results = asyncio.run(measure(args.url or server.url, args.runs))
    finally:
        if server is not None:
            server.close()
    results["src"] = args.src or str(ROOT / "src")
    print(f"server code: {results['src']}; max_model_len {results['max_model_len']}, prompt cap "
          f"{results['cap_chars']:,} characters")
    for name in SCENARIOS:
        r = results[name]
        statuses = sorted({s.get("tokenize_status") for s in r["samples"]} - {None})
        tokenize = [s["tokenize_s"] for s in r["samples"] if "tokenize_s" in s]
        first = sum(s.get("completion_first", True) for s in r["samples"])
        extra = (f"; /tokenize {statuses} in median {statistics.median(tokenize):.2f} s, completion first "
                 f"{first}/{len(r['samples'])}" if tokenize else "")
        print(f"{name:8s} {r['chars']:>12,} chars: 2-token completion median {r['completion_median_s'] * 1000:.0f} ms,"
              f" worst {r['completion_max_s'] * 1000:.0f} ms{extra}")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
