"""What a P/D pull of a long prompt costs against computing it (issue 36, item 3; kv_transfer/pd_connector.py).

    .venv/bin/python benchmarks/pd_transfer.py [--runs 5] [--tokens 4096] [--model PATH]

Starts a producer and a consumer `pagedllm serve` (the embedded SmolLM2-135M-Instruct unless --model, bfloat16,
1 GiB KV pool, one thread each) with the P/D connector, then, interleaved `--runs` times, for a fresh prompt of
about `--tokens` tokens:

- pd: the prompt to the producer (max_tokens 1, kv_transfer_params {"do_remote_decode": true}), then to the consumer
  with the answer's kv_transfer_params (streamed, max_tokens 2): the consumer's time to its first token is the pull
  plus one token's step; the bytes come from /metrics (pagedllm:kv_transfer_received_bytes_total);
- recompute: the same prompt to the consumer alone after /reset_prefix_cache (streamed, max_tokens 2): its time to
  the first token is the whole prefill.

Prints the medians: the producer's prefill, the consumer's first token after a pull, the recompute's first token,
the MB moved and the pull's throughput (MB / consumer first-token time, an underestimate: it includes the step).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]
from server_process import free_port, serve_command, serve_env, wait_healthy  # noqa: E402

WORDS = ("fox", "river", "stone", "cloud", "garden", "lamp", "window", "bridge", "forest", "candle", "letter", "road")


def start(model: str | None, role: str, kv_port: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_port": kv_port}
    proc = subprocess.Popen(serve_command(Path(model) if model else None, port, "--dtype", "bfloat16",
                                          "--kv-cache-memory", "1GiB", "--max-model-len", "8192",
                                          "--kv-transfer-config", json.dumps(config), debug_routes=True),
                            env=serve_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def first_token_s(url: str, body: dict) -> float:
    start = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True, "max_tokens": 2},
                      timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"][0]["text"]:
                return time.monotonic() - start
    raise RuntimeError("no token")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    producer, p_url = start(args.model, "kv_producer", free_port())
    consumer, d_url = start(args.model, "kv_consumer", free_port())
    samples: dict[str, list[float]] = {"prefill_s": [], "pd_first_token_s": [], "recompute_first_token_s": [],
                                       "mb": []}
    try:
        wait_healthy(producer, p_url, 300)
        wait_healthy(consumer, d_url, 300)
        model = httpx.get(p_url + "/v1/models").json()["data"][0]["id"]
        rng = random.Random(0)
        for run in range(args.runs):
            prompt = " ".join(rng.choice(WORDS) for _ in range(args.tokens - 8))
            body = {"model": model, "prompt": prompt, "temperature": 0.0}
            for url in (p_url, d_url):
                httpx.post(url + "/reset_prefix_cache", timeout=30)
            start_s = time.monotonic()
            prefill = httpx.post(p_url + "/v1/completions", timeout=600, json={
                **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
            samples["prefill_s"].append(time.monotonic() - start_s)
            received = metric(d_url, "pagedllm:kv_transfer_received_bytes_total")
            samples["pd_first_token_s"].append(first_token_s(d_url, {
                **body, "kv_transfer_params": prefill["kv_transfer_params"]}))
            samples["mb"].append((metric(d_url, "pagedllm:kv_transfer_received_bytes_total") - received) / 1e6)
            httpx.post(d_url + "/reset_prefix_cache", timeout=30)
            samples["recompute_first_token_s"].append(first_token_s(d_url, body))
            print(f"run {run}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in samples.items()), flush=True)
    finally:
        for proc in (producer, consumer):
            proc.terminate()
            proc.wait(30)
    medians = {k: statistics.median(v) for k, v in samples.items()}
    print("medians: " + ", ".join(f"{k} {v:.3f}" for k, v in medians.items())
          + f", pull >= {medians['mb'] / medians['pd_first_token_s']:.0f} MB/s")


if __name__ == "__main__":
    main()
