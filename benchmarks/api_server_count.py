"""--api-server-count 1 vs 2 (vs 4) at c64: `pagedllm serve` (the default SmolLM2 model) with N API servers, driven
by `pagedllm bench serve` (random short prompts, ignore_eos), the variants interleaved run by run.

    PYTHONPATH=src python benchmarks/api_server_count.py --counts 1 2 4 --runs 3 --num-prompts 256

Prints one line per run (output tok/s, TTFT and ITL medians, the 1-minute load average) and the medians per count.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CLI = [sys.executable, "-m", "pagedllm.entrypoints.cli.main"]


def serve(count: int, port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([*CLI, "serve", "--host", "127.0.0.1", "--port", str(port), "--api-server-count",
                             str(count), "--disable-log-requests", "--uvicorn-log-level", "warning"],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("server did not start")


def bench(port: int, args, folder: Path, name: str) -> dict:
    subprocess.run([*CLI, "bench", "serve", "--port", str(port), "--dataset-name", "random", "--random-input-len",
                    str(args.input_len), "--random-output-len", str(args.output_len), "--num-prompts",
                    str(args.num_prompts), "--max-concurrency", str(args.concurrency), "--ignore-eos",
                    "--disable-tqdm", "--save-result", "--result-dir", str(folder), "--result-filename", name],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads((folder / name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--port", type=int, default=18555)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="apiscale-bench-"))
    results: dict[int, list[tuple[float, float, float]]] = {n: [] for n in args.counts}
    for run in range(args.runs):
        for count in args.counts:
            proc = serve(count, args.port, folder / f"serve-{count}-{run}.log")
            try:
                r = bench(args.port, args, folder, f"{count}-{run}.json")
            finally:
                proc.send_signal(signal.SIGINT)
                proc.wait(60)
            row = (r["output_throughput"], r["median_ttft_ms"], r["median_itl_ms"])
            results[count].append(row)
            print(f"run {run} api-server-count {count}: output {row[0]:.1f} tok/s, TTFT median {row[1]:.0f} ms, "
                  f"ITL median {row[2]:.1f} ms, load {os.getloadavg()[0]:.1f}", flush=True)
    for count, rows in results.items():
        medians = [statistics.median(col) for col in zip(*rows, strict=True)]
        print(f"median api-server-count {count}: output {medians[0]:.1f} tok/s, TTFT {medians[1]:.0f} ms, "
              f"ITL {medians[2]:.1f} ms ({len(rows)} runs)")


if __name__ == "__main__":
    main()
