"""Check `pagedllm plan` against real servers: its recommendation meets the SLOs, one replica fewer misses them.

1. Sweep: start `pagedllm serve` (the default model, SmolLM2) as ONE replica: one engine, OMP_NUM_THREADS=1;
   run `pagedllm bench serve --save-result --max-concurrency C` for each C (random prompts of --input-len,
   --output-len tokens, ignore_eos).
2. Plan: size the workload from the sweep so the plan needs two replicas: a first plan at a trickle gives the
   capacity of one replica at the SLOs (its throughput bound), then users = --load-factor x that capacity x 60 /
   --requests-per-user-per-minute; `pagedllm plan` on that workload gives replicas R, --max-num-seqs and
   --kv-cache-memory-bytes.
3. Check: serve R replicas (`--data-parallel-size R`, OMP_NUM_THREADS=R: one thread per replica, round-robin
   routing) and then R - 1, each with the plan's --max-num-seqs and --kv-cache-memory-bytes, and run `pagedllm
   bench serve` with Poisson arrivals at lambda (--request-rate); compare its p99 TTFT and ITL with the SLOs.
   --repeats alternates the two settings.

    PYTHONPATH=src python benchmarks/plan_check.py --ttft-slo-ms 6000 --itl-slo-ms 200

The machine is shared: before each bench run the script waits (up to 2 minutes) for the 1-minute load average to
drop under --max-load, and prints the load average before and after each run. Results: --out-dir/check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CLI = [sys.executable, "-m", "pagedllm.entrypoints.cli.main"]


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def wait_for_quiet(max_load: float, max_wait_s: float = 120) -> None:
    """Wait (up to max_wait_s) until the 1-minute load average is under max_load: other users share the cores."""
    deadline = time.time() + max_wait_s
    while float(loadavg().split()[0]) >= max_load and time.time() < deadline:
        time.sleep(5)


def start_server(port: int, replicas: int, extra: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(replicas), "PAGEDLLM_DP_ROUTER": "round_robin"}
    cmd = [*CLI, "serve", "--port", str(port), "--data-parallel-size", str(replicas), "--max-model-len", "256",
           *extra]
    print("$", " ".join(cmd[2:]), f"(OMP_NUM_THREADS={replicas})", flush=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return proc
        except OSError:
            time.sleep(1)
    proc.terminate()
    raise TimeoutError("server not healthy after 300 s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def bench(args, out_dir: Path, name: str, extra: list[str]) -> dict:
    wait_for_quiet(args.max_load)
    cmd = [*CLI, "bench", "serve", "--port", str(args.port), "--dataset-name", "random", "--input-len",
           str(args.input_len), "--output-len", str(args.output_len), "--temperature", "0", "--disable-tqdm",
           "--save-result", "--result-dir", str(out_dir), "--result-filename", f"{name}.json", *extra]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads((out_dir / f"{name}.json").read_text())


def run_plan(args, sweep: list[Path], users: float, out: Path) -> dict:
    cmd = [*CLI, "plan", "--users", f"{users:.4f}", "--requests-per-user-per-minute",
           str(args.requests_per_user_per_minute), "--prompt-len", str(args.input_len), "--output-len",
           str(args.output_len), "--ttft-slo-ms", str(args.ttft_slo_ms), "--itl-slo-ms", str(args.itl_slo_ms),
           "--bench-result", *map(str, sweep), "--kv-memory-per-replica", "1GiB", "--max-model-len", "256",
           "--output-json", str(out)]
    print("$", " ".join(cmd[2:]), flush=True)
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return {"text": text, **json.loads(out.read_text())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8431)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrencies", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--sweep-requests-per-slot", type=int, default=4, help="--num-prompts = this x C")
    parser.add_argument("--ttft-slo-ms", type=float, default=6000)
    parser.add_argument("--itl-slo-ms", type=float, default=200)
    parser.add_argument("--requests-per-user-per-minute", type=float, default=6)
    parser.add_argument("--load-factor", type=float, default=1.3, help="lambda / one replica's capacity")
    parser.add_argument("--check-prompts", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out-dir", default="/tmp/plan_check")
    parser.add_argument("--max-load", type=float, default=3.5,
                        help="before each bench run, wait (up to 2 minutes) for the 1-minute load under this")
    parser.add_argument("--skip-sweep", action="store_true", help="reuse --out-dir's sweep files")
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    print("CPU:", next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                        if line.startswith("model name")), "?"), f"x {os.cpu_count()}; load", loadavg(), flush=True)

    sweep = [out_dir / f"sweep_c{c}.json" for c in args.concurrencies]
    if not args.skip_sweep:
        server = start_server(args.port, 1, ["--max-num-seqs", str(max(args.concurrencies))])
        try:
            bench(args, out_dir, "warmup", ["--num-prompts", "4", "--max-concurrency", "2"])
            for c in args.concurrencies:
                r = bench(args, out_dir, f"sweep_c{c}",
                          ["--num-prompts", str(args.sweep_requests_per_slot * c), "--max-concurrency", str(c)])
                print(f"  C={c}: {r['request_throughput']:.3f} req/s, p99 TTFT {r['p99_ttft_ms']:.0f} ms, "
                      f"p99 ITL {r['p99_itl_ms']:.1f} ms, mean ITL {r['mean_itl_ms']:.1f} ms; load {loadavg()}",
                      flush=True)
        finally:
            stop(server)

    probe = run_plan(args, sweep, 0.01, out_dir / "plan_probe.json")
    capacity = probe["bounds"]["throughput"]["per_replica_req_s"]
    lam = args.load_factor * capacity
    users = lam * 60 / args.requests_per_user_per_minute
    plan = run_plan(args, sweep, users, out_dir / "plan.json")
    print(plan["text"], flush=True)
    replicas, m, kv = plan["replicas"], plan["max_num_seqs"], plan["kv_cache_memory_bytes"]
    settings = [r for r in (replicas, replicas - 1) if r >= 1]
    if replicas > 2:
        print(f"warning: the plan asks {replicas} replicas; this 2-core machine runs them all the same", flush=True)
    rows = []
    for rep in range(args.repeats):
        for r in settings:
            server = start_server(args.port, r, ["--max-num-seqs", str(m), "--kv-cache-memory-bytes", str(kv)])
            try:
                before = loadavg()
                res = bench(args, out_dir, f"check_r{r}_{rep}",
                            ["--num-prompts", str(args.check_prompts), "--request-rate", f"{lam:.4f}",
                             "--seed", str(rep)])
            finally:
                stop(server)
            ok = res["p99_ttft_ms"] <= args.ttft_slo_ms and res["p99_itl_ms"] <= args.itl_slo_ms
            rows.append({"replicas": r, "repeat": rep, "p99_ttft_ms": res["p99_ttft_ms"],
                         "p99_itl_ms": res["p99_itl_ms"], "request_throughput": res["request_throughput"],
                         "completed": res["completed"], "meets_slos": ok, "load_before": before,
                         "load_after": loadavg()})
            print(f"  {r} replica(s): p99 TTFT {res['p99_ttft_ms']:.0f} ms, p99 ITL {res['p99_itl_ms']:.1f} ms, "
                  f"{res['request_throughput']:.3f} req/s: SLOs {'met' if ok else 'MISSED'}; load {before} -> "
                  f"{loadavg()}", flush=True)
    (out_dir / "check.json").write_text(json.dumps({"lambda": lam, "users": users, "plan": plan, "rows": rows},
                                                   indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
