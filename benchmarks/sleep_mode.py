"""Sleep mode (issue 35 item 7): the memory /sleep gives back and the time /wake_up takes, on a real server.

Starts `pagedllm serve` (default: the embedded SmolLM2-135M-Instruct) with --enable-sleep-mode and
--enable-debug-routes, then per cycle: the engine core's RSS awake (its KV pool faulted in), POST /sleep?level=L
(seconds), RSS asleep, POST /wake_up (seconds: the wake-up time), RSS right after and once the pool is resident
again, and a greedy completion compared with the one before the first sleep. Prints one JSON line per cycle and
the medians.

    PYTHONPATH=src python benchmarks/sleep_mode.py [--cycles 5] [--level 1] [--kv-cache-memory 1GiB] [--model M]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx

PROMPT = "The capital of France is"


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def settled_rss_mib(pid: int, timeout_s: float = 60.0) -> float:
    """RSS once it stops growing (the KV pool's background prefault has finished)."""
    last, deadline = rss_mib(pid), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = rss_mib(pid)
        if abs(now - last) < 1.0:
            return now
        last = now
    return last


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--port", type=int, default=18791)
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", *([args.model] if args.model else []),
           "--host", "127.0.0.1", "--port", str(args.port), "--kv-cache-memory", args.kv_cache_memory,
           "--enable-sleep-mode", "--enable-debug-routes", "--disable-log-stats", "--uvicorn-log-level", "warning"]
    started = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open("/tmp/pagedllm-sleep-bench.log", "w"))
    try:
        with httpx.Client(base_url=url, timeout=600) as http:
            while True:
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None:
                    raise SystemExit("server died; see /tmp/pagedllm-sleep-bench.log")
                time.sleep(0.1)
            cold_start_s = time.perf_counter() - started
            pid = http.get("/debug/kv_cache").json()["engine_pid"]
            model = http.get("/v1/models").json()["data"][0]["id"]

            def greedy() -> str:
                body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0.0}
                return http.post("/v1/completions", json=body).json()["choices"][0]["text"]

            reference = greedy()
            rows = []
            for cycle in range(args.cycles):
                awake = settled_rss_mib(pid)
                t = time.perf_counter()
                http.post(f"/sleep?level={args.level}").raise_for_status()
                sleep_s = time.perf_counter() - t
                asleep = rss_mib(pid)
                t = time.perf_counter()
                http.post("/wake_up").raise_for_status()
                wake_s = time.perf_counter() - t
                woken = rss_mib(pid)
                same = greedy() == reference
                rows.append({"cycle": cycle, "rss_awake_mib": round(awake, 1), "sleep_s": round(sleep_s, 3),
                             "rss_asleep_mib": round(asleep, 1), "freed_mib": round(awake - asleep, 1),
                             "wake_up_s": round(wake_s, 3), "rss_after_wake_mib": round(woken, 1),
                             "greedy_identical": same, "load": open("/proc/loadavg").read().split()[:3]})
                print(json.dumps(rows[-1]), flush=True)
            summary = {key: statistics.median(r[key] for r in rows)
                       for key in ("rss_awake_mib", "rss_asleep_mib", "freed_mib", "sleep_s", "wake_up_s")}
            summary |= {"cold_start_s": round(cold_start_s, 2), "level": args.level,
                        "kv_cache_memory": args.kv_cache_memory, "model": model, "cycles": args.cycles,
                        "all_greedy_identical": all(r["greedy_identical"] for r in rows),
                        "cpu_count": os.cpu_count()}
            print(json.dumps({"median": summary}))
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
