"""A heavy grammar's cost to its neighbours (issue 32, item 3): how much does one request under a 2,000-branch
`anyOf` JSON schema slow a concurrent unconstrained stream?

    .venv/bin/python benchmarks/structured_outputs_mask_cost.py [--runs 3] [--branches 2000] [--url URL]
        [-- EXTRA SERVE FLAGS]

Starts `pagedllm serve` (the embedded SmolLM2-135M-Instruct) unless `--url` names a running server. Each run
streams one unconstrained completion (`--stream-tokens` tokens, ignore_eos, temperature 0) three times: alone;
beside an unconstrained chat completion of `--constrained-tokens` tokens (the control: what a second row costs);
and beside a chat completion under the anyOf schema (`--branches` objects, each with its own required key; a new
schema every run, so that no run finds it compiled already), sent `--lead-s` before the stream starts.
`--shape patterns` gives each branch a string pattern of its own instead (masks of ~20 ms at the branching
tokens, ~0.1-8 ms for `keys`). Prints, per phase, the medians over `--runs` of the stream's longest inter-token
gap and total time (from sending to the last chunk), with every run's figures; `--result-file` writes them as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "reliability"), str(ROOT / "tests")]
from reliability_utils import Server  # noqa: E402


def anyof_schema(branches: int, salt: int, shape: str = "keys") -> dict:
    """`branches` alternatives, each an object with one required key of its own (the key names differ per salt),
    or (`patterns`) with one key whose string ends in the branch's own number."""
    if shape == "patterns":
        return {"anyOf": [{"type": "object", "properties": {"text": {"type": "string",
                                                                     "pattern": f"^[a-z ]{{0,40}}{salt}{i}$"}},
                           "required": ["text"], "additionalProperties": False} for i in range(branches)]}
    return {"anyOf": [{"type": "object", "properties": {f"key_{salt}_{i}": {"type": "string", "maxLength": 40}},
                       "required": [f"key_{salt}_{i}"], "additionalProperties": False} for i in range(branches)]}


async def stream(client: httpx.AsyncClient, model: str, tokens: int) -> dict:
    """One unconstrained streamed completion: its chunks' longest gap (and when it began, from the request's
start), its total time and its text."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True,
            "stream": True, "temperature": 0.0}
    start = time.monotonic()
    last, worst, worst_at, text, chunks = start, 0.0, 0.0, [], 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                now = time.monotonic()
                if chunks and now - last > worst:
                    worst, worst_at = now - last, last - start
                last = now
                chunks += 1
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return {"max_gap_s": worst, "max_gap_at_s": worst_at, "total_s": last - start, "chunks": chunks,
            "text": "".join(text)}


async def constrained(client: httpx.AsyncClient, model: str, schema: dict | None, tokens: int) -> dict:
    """A chat completion under `schema` (None: unconstrained, ignore_eos: the control)."""
    body = {"model": model, "max_tokens": tokens, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Give me one JSON object."}]}
    if schema is None:
        body["ignore_eos"] = True
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "many", "schema": schema}}
    start = time.monotonic()
    response = await client.post("/v1/chat/completions", json=body)
    out = {"status": response.status_code, "latency_s": time.monotonic() - start}
    if response.status_code == 200:
        choice = response.json()["choices"][0]
        out.update(finish_reason=choice["finish_reason"], content=choice["message"]["content"],
                   tokens=response.json()["usage"]["completion_tokens"])
    else:
        out["error"] = response.text[:300]
    return out


async def measure(url: str, model: str, runs: int, branches: int, stream_tokens: int, constrained_tokens: int,
                  lead_s: float, shape: str) -> dict:
    alone, beside_plain, beside, heavy = [], [], [], []
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as client:
        await stream(client, model, 8)  # warm-up; then a small grammar, so that the engine's one-time grammar
        # backend set-up (the tokenizer's vocabulary for llguidance, ~1 s) is not counted in the first run
        await constrained(client, model, {"type": "object", "properties": {"a": {"type": "integer"}}}, 4)
        for run in range(runs):
            alone.append(await stream(client, model, stream_tokens))
            task = asyncio.create_task(constrained(client, model, None, constrained_tokens))
            await asyncio.sleep(lead_s)
            beside_plain.append(await stream(client, model, stream_tokens))
            await task
            salt = int(time.time() * 1000) % 1_000_000 + run
            schema = anyof_schema(branches, salt, shape)
            task = asyncio.create_task(constrained(client, model, schema, constrained_tokens))
            await asyncio.sleep(lead_s)
            beside.append(await stream(client, model, stream_tokens))
            heavy.append(await task)
            print(f"run {run}: alone gap {alone[-1]['max_gap_s']:.3f} s total {alone[-1]['total_s']:.2f} s | "
                  f"beside plain gap {beside_plain[-1]['max_gap_s']:.3f} s total {beside_plain[-1]['total_s']:.2f} s | "
                  f"beside gap {beside[-1]['max_gap_s']:.3f} s total {beside[-1]['total_s']:.2f} s | constrained "
                  f"{heavy[-1]['status']} {heavy[-1].get('tokens')} tokens in {heavy[-1]['latency_s']:.2f} s",
                  flush=True)

    def summary(results: list[dict]) -> dict:
        return {"median_max_gap_s": statistics.median(r["max_gap_s"] for r in results),
                "median_total_s": statistics.median(r["total_s"] for r in results),
                "max_gap_s": [round(r["max_gap_s"], 4) for r in results],
                "max_gap_at_s": [round(r["max_gap_at_s"], 3) for r in results],
                "total_s": [round(r["total_s"], 3) for r in results]}

    return {"branches": branches, "shape": shape, "stream_tokens": stream_tokens, "runs": runs,
            "load_avg_1m": os.getloadavg()[0],
            "alone": summary(alone),
            "beside_unconstrained": summary(beside_plain), "beside_constrained": summary(beside),
            "same_text": all(a["text"] == b["text"] == c["text"] for a, b, c in zip(alone, beside_plain, beside,
                                                                                      strict=True)),
            "constrained": [{k: v for k, v in h.items() if k != "content"} for h in heavy],
            "constrained_content": heavy[-1].get("content")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--branches", type=int, default=2000)
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--constrained-tokens", type=int, default=64)
    parser.add_argument("--lead-s", type=float, default=0.0)
    parser.add_argument("--shape", choices=("keys", "patterns"), default="keys")
    parser.add_argument("--result-file")
    parser.add_argument("serve_args", nargs="*")
    args = parser.parse_args()
    server = None
    url, model = args.url, "tiny"
    if url is None:
        log = Path(tempfile.mkdtemp(prefix="mask-cost-")) / "server.log"
        server = Server(None, log, "--kv-cache-memory", "512MiB", *args.serve_args, env={"OMP_NUM_THREADS": "2"})
        url = server.url
        print(f"server log: {log}")
    else:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    try:
        result = asyncio.run(measure(url, model, args.runs, args.branches, args.stream_tokens,
                                     args.constrained_tokens, args.lead_s, args.shape))
    finally:
        if server is not None:
            server.close()
    print(json.dumps(result, indent=1))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
