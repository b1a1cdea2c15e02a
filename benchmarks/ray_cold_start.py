"""Cold start of `pagedllm serve --pipeline-parallel-size 2`: seconds from the command to /health 200, with
`--distributed-executor-backend ray` on an already running two-node Ray cluster (tests/reliability/
test_ray_cluster.py's: 127.0.0.2 and 127.0.0.3, one CPU each) against mp, the same model and flags, the backends
alternating run by run. Prints one line per start and writes the figures (with the 1-minute load average at each
start) as JSON.

    PYTHONPATH=src nice -n 19 .venv/bin/python benchmarks/ray_cold_start.py --runs 3 \
        --out benchmarks/results/scale_out/cold_start.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "reliability"), str(ROOT / "tests")]
from reliability_utils import Server  # noqa: E402
from test_ray_cluster import start_ray_cluster  # noqa: E402

FLAGS = ("--pipeline-parallel-size", "2", "--kv-cache-memory", "64MiB", "--max-model-len", "512")


def cold_start(folder: Path, name: str, *flags: str) -> dict:
    load = os.getloadavg()[0]
    start = time.monotonic()
    server = Server(None, folder / f"{name}.log", *FLAGS, *flags, wait_ready=False)
    try:
        server.wait_ready(timeout_s=600.0)
        seconds = time.monotonic() - start
    finally:
        server.close()
    print(f"{name}: healthy after {seconds:.1f} s (load average {load:.1f})", flush=True)
    return {"backend": name.split("-")[0], "seconds": round(seconds, 2), "load_average_1m": round(load, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="cold-start-"))
    (folder / "ray-cluster").mkdir()
    runs = []
    with start_ray_cluster(folder / "ray-cluster") as cluster:
        ray_flags = ("--distributed-executor-backend", "ray", "--ray-address", cluster.address)
        for i in range(args.runs):
            order = [("ray", ray_flags), ("mp", ())] if i % 2 == 0 else [("mp", ()), ("ray", ray_flags)]
            for backend, flags in order:
                runs.append(cold_start(folder, f"{backend}-{i}", *flags))
    result = {"model": "default (SmolLM2-135M-Instruct GGUF)", "flags": list(FLAGS), "logs": str(folder),
              "runs": runs}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
