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

`--engine` measures the engine alone instead (EngineCore in this process, no HTTP, no API server): the stream's
gaps between the steps that give it a token, alone and with the constrained request added after its 10th token
(the time add_request took is reported too), so the engine's share of the gap is seen apart from the API
server's (request parsing, validation).
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


def measure_engine(runs: int, branches: int, stream_tokens: int, constrained_tokens: int, shape: str,
                   threads: int) -> dict:
    import torch

    from pagedllm.config import EngineConfig
    from pagedllm.engine.core import EngineCore
    from pagedllm.messages import EngineCoreRequest
    from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

    torch.set_num_threads(threads)
    core = EngineCore(EngineConfig.from_kwargs(model="SmolLM2-135M-Instruct", dtype="float32",
                                               kv_cache_memory=256 << 20, max_model_len=2048))
    tokenizer = core._load_tokenizer()
    prompt = tokenizer.encode("Once upon a time")
    chat = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Give me one JSON object."}],
                                                          add_generation_prompt=True, tokenize=False))

    def request(request_id: str, tokens: list[int], max_tokens: int, schema: dict | None) -> EngineCoreRequest:
        params = (SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True) if schema is None else
                  SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                 structured_outputs=StructuredOutputsParams(json=schema)))
        return EngineCoreRequest(request_id=request_id, prompt_token_ids=tokens, sampling_params=params,
                                 eos_token_id=tokenizer.eos_token_id, arrival_time=time.time())

    def run(tag: str, schema: dict | None) -> dict:
        core.add_request(request(f"u-{tag}", prompt, stream_tokens, None))
        gaps, last, add_s, tokens = [], time.perf_counter(), 0.0, 0
        while core.has_unfinished_requests():
            if tokens == 10 and schema is not None and not add_s:
                start = time.perf_counter()
                core.add_request(request(f"c-{tag}", chat, constrained_tokens, schema))
                add_s = time.perf_counter() - start
            for out in core.step().outputs:
                if out.request_id.startswith("u-") and out.new_token_ids:
                    now = time.perf_counter()
                    if tokens:
                        gaps.append(now - last)
                    last, tokens = now, tokens + 1
        return {"max_gap_s": max(gaps), "total_s": sum(gaps), "add_request_s": add_s}

    run("warm", {"type": "object", "properties": {"a": {"type": "integer"}}})  # the grammar backend's set-up
    alone, beside = [], []
    for i in range(runs):
        alone.append(run(f"a{i}", None))
        beside.append(run(f"b{i}", anyof_schema(branches, int(time.time() * 1000) % 1_000_000 + i, shape)))
        print(f"run {i}: alone gap {alone[-1]['max_gap_s']:.3f} s total {alone[-1]['total_s']:.2f} s | beside gap "
              f"{beside[-1]['max_gap_s']:.3f} s total {beside[-1]['total_s']:.2f} s add_request "
              f"{beside[-1]['add_request_s'] * 1000:.0f} ms", flush=True)
    core.shutdown()

    def summary(results: list[dict]) -> dict:
        return {key: statistics.median(r[key] for r in results) for key in results[0]}

    return {"engine": True, "branches": branches, "shape": shape, "threads": threads, "runs": runs,
            "load_avg_1m": os.getloadavg()[0], "alone": summary(alone), "beside_constrained": summary(beside)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--branches", type=int, default=2000)
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--constrained-tokens", type=int, default=64)
    parser.add_argument("--lead-s", type=float, default=0.0)
    parser.add_argument("--shape", choices=("keys", "patterns"), default="keys")
    parser.add_argument("--engine", action="store_true", help="the engine alone, in this process")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (--engine)")
    parser.add_argument("--result-file")
    parser.add_argument("serve_args", nargs="*")
    args = parser.parse_args()
    if args.engine:
        result = measure_engine(args.runs, args.branches, args.stream_tokens, args.constrained_tokens, args.shape,
                                args.threads)
        print(json.dumps(result, indent=1))
        if args.result_file:
            Path(args.result_file).write_text(json.dumps(result, indent=1))
        return 0
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
