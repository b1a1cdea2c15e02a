"""/health under a flood of half-open connections (issue 32, item 6).

    .venv/bin/python benchmarks/half_open_connections.py [--connections 4500] [--probes 25] [--src DIR]
        [--url URL] [-- EXTRA SERVE FLAGS]

Starts `pagedllm serve` of the tiny test model (default flags: --max-connections 4096, --header-read-timeout
10) unless `--url` names a running server; `--src DIR` serves another checkout's package (its `src` folder
goes first on the server's PYTHONPATH), e.g. main's for the before figure:

    git archive main src | tar -x -C /tmp/main-tree
    .venv/bin/python benchmarks/half_open_connections.py --src /tmp/main-tree/src

Then opens `--connections` connections that send half a request head (`GET /health HTTP/1.1`, one header,
never the blank line) and, while they are open (well inside the head deadline), sends `--probes` GET /health,
each on a fresh connection, 0.2 s apart. Prints how many probes answered 200 (and what the others got) and the
median and worst probe latency; `--result-file` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "reliability"), str(ROOT / "tests")]
from reliability_utils import Server  # noqa: E402

from server_process import build_tiny_model  # noqa: E402

PARTIAL_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\n"


def _silent_and_open(sock: socket.socket) -> bool:
    """The server has neither written to nor closed this connection."""
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        pass
    return False


def measure(url: str, port: int, connections: int, probes: int) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, connections + 1024)), hard))
    held, refused = [], 0
    start = time.monotonic()
    for _ in range(connections):
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(PARTIAL_HEAD)
            held.append(sock)
        except OSError:
            refused += 1
    flood_s = time.monotonic() - start
    statuses, latencies = [], []
    try:
        for _ in range(probes):
            begin = time.monotonic()
            try:
                status = httpx.get(url + "/health", headers={"Connection": "close"}, timeout=30.0).status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            latencies.append(time.monotonic() - begin)
            statuses.append(status)
            time.sleep(max(0.0, 0.2 - latencies[-1]))
    finally:
        still_open = sum(_silent_and_open(sock) for sock in held)
        for sock in held:
            sock.close()
    return {"connections": connections, "connect_refused": refused, "flood_s": round(flood_s, 2),
            "probes": probes, "health_200": statuses.count(200),
            "health_other": {str(s): statuses.count(s) for s in sorted(set(statuses), key=str) if s != 200},
            "median_latency_ms": round(statistics.median(latencies) * 1000, 1),
            "max_latency_ms": round(max(latencies) * 1000, 1),
            "flood_connections_still_open": still_open}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url")
    parser.add_argument("--src", help="serve this package source folder instead of the installed one")
    parser.add_argument("--connections", type=int, default=4500)
    parser.add_argument("--probes", type=int, default=25)
    parser.add_argument("--result-file")
    parser.add_argument("serve_args", nargs="*")
    args = parser.parse_args()
    server = None
    url = args.url
    if url is None:
        folder = Path(tempfile.mkdtemp(prefix="half-open-"))
        model = build_tiny_model(folder)
        env = {}
        if args.src:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.src, os.environ.get("PYTHONPATH")]))
        server = Server(model, folder / "server.log", *args.serve_args, env=env)
        url = server.url
        print(f"server log: {folder / 'server.log'}")
    try:
        result = measure(url, int(url.rsplit(":", 1)[1].split("/")[0]), args.connections, args.probes)
    finally:
        if server is not None:
            server.close()
    print(json.dumps(result, indent=1))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
