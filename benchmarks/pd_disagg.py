"""Disaggregated prefill/decode behind vllm-router against one colocated server at the same core budget
(issue 36: TTFT and p99 ITL with 4k-token prompts mixed with short ones).

    .venv/bin/python benchmarks/pd_disagg.py [--runs 3] [--long-tokens 4096] [--out FILE.json] [-- EXTRA SERVE FLAGS]

Two variants, each behind vllm-router (the same client path), measured interleaved in one sitting (the order
alternates run by run):
- colocated: one `pagedllm serve` with OMP_NUM_THREADS=2, pinned to cores 0,1 (`taskset -c 0,1`), behind
  `vllm-router --worker-urls`;
- colocated-passive (only when named in --variants): the same with OMP_WAIT_POLICY=PASSIVE (OpenMP threads sleep
  at once instead of spinning: the README's advice for a machine crowded by other processes);
- pd: a producer (`--kv-transfer-config {"kv_connector":"NixlConnector","kv_role":"kv_producer"}`,
  OMP_NUM_THREADS=1, `taskset -c 0`) and a consumer (kv_consumer, OMP_NUM_THREADS=1, `taskset -c 1`) behind
  `vllm-router --vllm-pd-disaggregation --prefill P --decode D`.
The router and this client are not pinned (they are light: a few ms of CPU per request). Every server serves the
embedded SmolLM2-135M-Instruct (GGUF) with --max-model-len 8192 and --kv-cache-memory 1GiB (flags after `--`
are added to all three), started once; each run uses new random prompts, so no run hits the prefix cache of an
earlier one.

One run of a variant: `--long` requests of `--long-tokens` random token ids (`--long-output` tokens out), the
first after 1 s and then every `--long-gap` s, while `--short-users` clients each send short requests back to back
(`--short-tokens` random ids, `--short-output` tokens out, ignore_eos) until the last long request has ended.
Every request streams (greedy). TTFT is the time to the first streamed token; ITL the gaps between streamed
chunks. Prints and writes (`--out`) per variant the medians over runs of: TTFT median and p99 (short requests,
long requests, all), ITL p99 (all streams, and the short streams alone), requests and tokens, and the load
average at each run's start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

_BESIDE = Path(sys.executable).with_name("vllm-router")
ROUTER = str(_BESIDE) if _BESIDE.exists() else shutil.which("vllm-router")
MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process with its output in `log`; `url` once it listens on `port`."""

    def __init__(self, argv: list[str], log: Path, port: int, env: dict[str, str] | None = None):
        self.port, self.url, self.log = port, f"http://127.0.0.1:{port}", log
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args[:3]} exited:\n{self.log.read_text(errors='replace')[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"{self.url} did not become healthy")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


def serve(logdir: Path, name: str, cores: str, threads: int, extra: list[str],
          env: dict[str, str] | None = None) -> Proc:
    port = free_port()
    argv = ["taskset", "-c", cores, sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve",
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL, "--max-model-len", "8192",
            "--kv-cache-memory", "1GiB", "--disable-log-stats", "--uvicorn-log-level", "warning", *extra]
    return Proc(argv, logdir / f"{name}.log", port,
                env={"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                     "TOKENIZERS_PARALLELISM": "false", **(env or {})})


def router(logdir: Path, name: str, args: list[str]) -> Proc:
    port = free_port()
    argv = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
            "--prometheus-port", str(free_port()), "--log-level", "warning", "--disable-retries", *args]
    return Proc(argv, logdir / f"{name}.log", port)


def kv_config(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_port": free_port()})


async def stream_one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int, kind: str) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    times: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                    times.append(time.perf_counter())
    return {"kind": kind, "ttft": times[0] - start, "itl": [b - a for a, b in zip(times, times[1:], strict=False)],
            "chunks": len(times), "end": times[-1] - start}


async def one_run(url: str, args, seed: int) -> list[dict]:
    rng = random.Random(seed)
    longs = [[rng.randrange(1000, 40000) for _ in range(args.long_tokens)] for _ in range(args.long)]
    results: list[dict] = []
    done = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=900.0) as client:

        async def long_request(i: int) -> None:
            await asyncio.sleep(1.0 + i * args.long_gap)
            results.append(await stream_one(client, longs[i], args.long_output, "long"))

        async def short_user(u: int) -> None:
            user_rng = random.Random(seed * 1000 + u)
            while not done.is_set():
                prompt = [user_rng.randrange(1000, 40000) for _ in range(args.short_tokens)]
                results.append(await stream_one(client, prompt, args.short_output, "short"))

        users = [asyncio.create_task(short_user(u)) for u in range(args.short_users)]
        await asyncio.gather(*(long_request(i) for i in range(args.long)))
        done.set()
        await asyncio.gather(*users)
    return results


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * len(values) + 0.5) - 1))]


def summarize(results: list[dict], wall: float) -> dict:
    short = [r for r in results if r["kind"] == "short"]
    long = [r for r in results if r["kind"] == "long"]
    itl_all = [g for r in results for g in r["itl"]]
    itl_short = [g for r in short for g in r["itl"]]
    ms = 1000.0
    return {
        "ttft_short_median_ms": statistics.median(r["ttft"] for r in short) * ms if short else None,
        "ttft_short_p99_ms": pct([r["ttft"] for r in short], 99) * ms,
        "ttft_long_median_ms": statistics.median(r["ttft"] for r in long) * ms if long else None,
        "ttft_all_median_ms": statistics.median(r["ttft"] for r in results) * ms,
        "ttft_all_p99_ms": pct([r["ttft"] for r in results], 99) * ms,
        "itl_p99_ms": pct(itl_all, 99) * ms,
        "itl_median_ms": statistics.median(itl_all) * ms,
        "itl_short_p99_ms": pct(itl_short, 99) * ms,
        "itl_max_ms": max(itl_all) * ms,
        "requests_short": len(short),
        "requests_long": len(long),
        "output_tokens": sum(r["chunks"] for r in results),
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--long", type=int, default=2, help="Long requests per run.")
    parser.add_argument("--long-tokens", type=int, default=4096)
    parser.add_argument("--long-output", type=int, default=16)
    parser.add_argument("--long-gap", type=float, default=20.0, help="Seconds between two long requests.")
    parser.add_argument("--short-users", type=int, default=2)
    parser.add_argument("--short-tokens", type=int, default=64)
    parser.add_argument("--short-output", type=int, default=32)
    parser.add_argument("--variants", default="colocated,pd")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("serve_args", nargs="*")
    args = parser.parse_args()
    if ROUTER is None:
        sys.exit("vllm-router is not installed (pip install vllm-router)")
    logdir = Path(tempfile.mkdtemp(prefix="pd-disagg-"))
    print(f"logs: {logdir}", flush=True)
    variants = args.variants.split(",")
    procs: list[Proc] = []
    urls: dict[str, str] = {}
    try:
        colocated = {}
        for variant in ("colocated", "colocated-passive"):
            if variant in variants:
                env = {"OMP_WAIT_POLICY": "PASSIVE"} if variant.endswith("passive") else None
                colocated[variant] = serve(logdir, variant, "0,1", 2, args.serve_args, env)
                procs.append(colocated[variant])
        if "pd" in variants:
            producer = serve(logdir, "producer", "0", 1, ["--kv-transfer-config", kv_config("kv_producer"),
                                                          *args.serve_args])
            consumer = serve(logdir, "consumer", "1", 1, ["--kv-transfer-config", kv_config("kv_consumer"),
                                                          *args.serve_args])
            procs += [producer, consumer]
        for proc in procs:
            proc.wait_healthy()
        for variant, server in colocated.items():
            procs.append(router(logdir, f"router-{variant}", ["--worker-urls", server.url]))
            urls[variant] = procs[-1].url
        if "pd" in variants:
            procs.append(router(logdir, "router-pd", ["--vllm-pd-disaggregation", "--prefill", producer.url,
                                                      "--decode", consumer.url]))
            urls["pd"] = procs[-1].url
        for proc in procs:
            proc.wait_healthy()
        for variant in variants:  # warm-up: one short request each
            asyncio.run(_warm(urls[variant]))
        per_run: dict[str, list[dict]] = {v: [] for v in variants}
        for run in range(args.runs):
            order = variants if run % 2 == 0 else variants[::-1]
            for variant in order:
                load = Path("/proc/loadavg").read_text().split()[:3]
                start = time.perf_counter()
                results = asyncio.run(one_run(urls[variant], args, seed=run + 1))
                summary = {**summarize(results, time.perf_counter() - start), "loadavg": " ".join(load)}
                per_run[variant].append(summary)
                print(f"run {run} {variant}: {json.dumps(summary)}", flush=True)
        report = {"args": {k: v for k, v in vars(args).items() if k != "out"}, "cpu": _cpu(), "runs": per_run,
                  "medians": {v: _medians(per_run[v]) for v in variants}}
        print(json.dumps(report["medians"], indent=1))
        if args.out:
            args.out.write_text(json.dumps(report, indent=1, default=str))
    finally:
        for proc in reversed(procs):
            proc.close()


async def _warm(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300.0) as client:
        await stream_one(client, list(range(1000, 1016)), 4, "warm")


def _medians(runs: list[dict]) -> dict:
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    return f"x{os.cpu_count()}"


if __name__ == "__main__":
    main()
