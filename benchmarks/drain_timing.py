"""How long `pagedllm serve` takes to stop on SIGTERM with a stream open: the figures deploy/k8s/ sizes its
terminationGracePeriodSeconds and preStop from (deploy/k8s/README.md).

    python benchmarks/drain_timing.py [--drain-timeout 10] [--runs 2] [MODEL]

Each run starts a server (default model), waits for /health, opens a streaming completion that would outlast the
drain (ignore_eos, many tokens), sends SIGTERM once the first tokens arrived, and records (seconds after SIGTERM):
/health answering 503 (a readiness probe fails from then on), the stream's end (finish_reason "abort" when the drain
timeout ran out), and the process' exit. Prints one JSON line per run and the load average.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def one_run(model: str | None, drain_timeout: float) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", *([model] if model else []),
               "--host", "127.0.0.1", "--port", str(port), "--drain-timeout", str(drain_timeout),
               "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    start = time.monotonic()
    while status(f"{base}/health") != 200:
        if proc.poll() is not None:
            raise RuntimeError("server exited during start-up")
        time.sleep(0.2)
    cold_start = time.monotonic() - start
    model_id = json.loads(urllib.request.urlopen(f"{base}/v1/models").read())["data"][0]["id"]
    body = json.dumps({"model": model_id, "prompt": "Count to a thousand:", "max_tokens": 4000, "ignore_eos": True,
                       "stream": True}).encode()
    first_token = threading.Event()
    stream: dict = {}

    def read_stream() -> None:
        request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    first_token.set()
                    chunk = json.loads(line[6:])
                    reason = chunk["choices"][0].get("finish_reason") if chunk.get("choices") else None
                    stream["finish_reason"] = reason or stream.get("finish_reason")
        stream["ended"] = time.monotonic()

    reader = threading.Thread(target=read_stream, daemon=True)
    reader.start()
    first_token.wait(120)
    sigterm = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    health_503 = None
    while proc.poll() is None:
        if health_503 is None and status(f"{base}/health") == 503:
            health_503 = time.monotonic() - sigterm
        time.sleep(0.05)
    exited = time.monotonic() - sigterm
    reader.join(10)
    return {"cold_start_s": round(cold_start, 2), "drain_timeout_s": drain_timeout,
            "health_503_after_s": None if health_503 is None else round(health_503, 2),
            "stream_end_after_s": round(stream["ended"] - sigterm, 2) if "ended" in stream else None,
            "finish_reason": stream.get("finish_reason"), "exit_after_s": round(exited, 2),
            "exit_code": proc.returncode, "load": " ".join(open("/proc/loadavg").read().split()[:3])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--drain-timeout", type=float, default=10.0)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    for _ in range(args.runs):
        print(json.dumps(one_run(args.model, args.drain_timeout)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
