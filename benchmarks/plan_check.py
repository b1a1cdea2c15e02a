"""Check `pagedllm plan` against real servers: its recommendation meets the SLOs, one replica fewer misses them.

Every replica gets the same resources in the sweep and in the check: each server and its bench client run under
`taskset -c` on as many cores as the server has replicas (one core per replica; OMP_NUM_THREADS = replicas, one
engine thread per replica), so a replica shares its core with its share of the API server's and the client's
work, whether it is the sweep's one replica, one of the plan's R or one of R - 1. The sweep measures exactly what
each replica of the check gets (its core, and the API server and client work its own arrivals cause) and the
R - 1 run gets no more per replica than that (the same cores per replica, the same per-replica arrival work
plus a higher rate: what "one replica fewer" means). Unpinned, a 2-core machine gave the sweep's one replica a
free core for the API server and client and the check's two replicas none: 0.8-1.0x the sweep's capacity each.

1. Sweep: start `pagedllm serve` (the default model, SmolLM2) as ONE replica pinned to one core; run `pagedllm
   bench serve --save-result --max-concurrency C` (pinned to the same core) for each C (random prompts of
   --input-len, --output-len tokens, ignore_eos).
2. Plan: size the workload from the sweep so the plan needs two replicas: a first plan at a trickle gives the
   capacity of one replica at the SLOs (its throughput bound), then users = --load-factor x that capacity x 60 /
   --requests-per-user-per-minute; `pagedllm plan` on that workload gives replicas R, --max-num-seqs and
   --kv-cache-memory-bytes.
3. Check: serve R replicas (`--data-parallel-size R`, round-robin routing, pinned to R cores) and then R - 1
   (R - 1 cores), each with the plan's --max-num-seqs and --kv-cache-memory-bytes, and run `pagedllm bench serve`
   with Poisson arrivals at lambda (--request-rate); compare its p99 TTFT and ITL with the SLOs. --repeats
   alternates the two settings. The last line is the verdict: "plan: met|missed; minus one: met|missed" (met:
   both p99 SLOs held in every repeat; missed: at least one SLO missed in every repeat; mixed: neither).

    PYTHONPATH=src python benchmarks/plan_check.py --ttft-slo-ms 6000 --itl-slo-ms 200 --result-name quiet1

The machine is shared: before each bench run the script waits (up to 2 minutes) for the 1-minute load average to
drop under --max-load, and prints the load average before and after each run. Raw files: --out-dir; the summary
(plan, rows, verdict, loads, CPU): benchmarks/results/plan_check/<--result-name>.json.
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
RESULTS = Path(__file__).resolve().parent / "results" / "plan_check"
CORES = sorted(os.sched_getaffinity(0))


def pinned(replicas: int, pin: bool) -> list[str]:
    """`taskset -c` on one core per replica (all cores if there are fewer than replicas); [] unpinned."""
    if not pin:
        return []
    return ["taskset", "-c", ",".join(map(str, CORES[:max(1, replicas)]))]


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def wait_for_quiet(max_load: float, max_wait_s: float = 120) -> None:
    """Wait (up to max_wait_s) until the 1-minute load average is under max_load: other users share the cores."""
    deadline = time.time() + max_wait_s
    while float(loadavg().split()[0]) >= max_load and time.time() < deadline:
        time.sleep(5)


def start_server(port: int, replicas: int, extra: list[str], pin: bool) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(replicas), "PAGEDLLM_DP_ROUTER": "round_robin"}
    cmd = [*pinned(replicas, pin), *CLI, "serve", "--port", str(port), "--data-parallel-size", str(replicas),
           "--max-model-len", "256", *extra]
    print("$", " ".join(cmd), f"(OMP_NUM_THREADS={replicas})", flush=True)
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


def bench(args, out_dir: Path, name: str, extra: list[str], replicas: int) -> dict:
    wait_for_quiet(args.max_load)
    cmd = [*pinned(replicas, args.pin), *CLI, "bench", "serve", "--port", str(args.port), "--dataset-name", "random",
           "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--temperature", "0",
           "--disable-tqdm",
           "--save-result", "--result-dir", str(out_dir), "--result-filename", f"{name}.json", *extra]
    print("$", " ".join(cmd), flush=True)
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


def parse_args() -> argparse.Namespace:
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
    parser.add_argument("--result-name", default=time.strftime("check_%Y%m%d_%H%M%S", time.gmtime()),
                        help="the summary goes to benchmarks/results/plan_check/<this>.json")
    parser.add_argument("--max-load", type=float, default=3.5,
                        help="before each bench run, wait (up to 2 minutes) for the 1-minute load under this")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="do not pin servers and clients to one core per replica (the old, unfair check)")
    parser.add_argument("--skip-sweep", action="store_true", help="reuse --out-dir's sweep files")
    return parser.parse_args()


def sweep_one_replica(args, out_dir: Path) -> None:
    server = start_server(args.port, 1, ["--max-num-seqs", str(max(args.concurrencies))], args.pin)
    try:
        bench(args, out_dir, "warmup", ["--num-prompts", "4", "--max-concurrency", "2"], 1)
        for c in args.concurrencies:
            r = bench(args, out_dir, f"sweep_c{c}",
                      ["--num-prompts", str(args.sweep_requests_per_slot * c), "--max-concurrency", str(c)], 1)
            print(f"  C={c}: {r['request_throughput']:.3f} req/s, p99 TTFT {r['p99_ttft_ms']:.0f} ms, "
                  f"p99 ITL {r['p99_itl_ms']:.1f} ms, mean ITL {r['mean_itl_ms']:.1f} ms; load {loadavg()}",
                  flush=True)
    finally:
        stop(server)


def verdict(rows: list[dict], replicas: int) -> str:
    """"plan: met|missed|mixed; minus one: met|missed|mixed" over the repeats (module docstring)."""
    def word(r: int) -> str:
        oks = [row["meets_slos"] for row in rows if row["replicas"] == r]
        return "met" if oks and all(oks) else "missed" if oks and not any(oks) else "mixed" if oks else "not run"
    return f"plan: {word(replicas)}; minus one: {word(replicas - 1) if replicas > 1 else 'not run (1 replica)'}"


def main() -> int:
    args = parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    print("CPU:", cpu, f"x {len(CORES)} usable; load", loadavg(), f"; pinned: {args.pin}", flush=True)
    sweep = [out_dir / f"sweep_c{c}.json" for c in args.concurrencies]
    if not args.skip_sweep:
        sweep_one_replica(args, out_dir)

    probe = run_plan(args, sweep, 0.01, out_dir / "plan_probe.json")
    capacity = probe["bounds"]["throughput"]["per_replica_req_s"]
    lam = args.load_factor * capacity
    users = lam * 60 / args.requests_per_user_per_minute
    plan = run_plan(args, sweep, users, out_dir / "plan.json")
    print(plan["text"], flush=True)
    replicas, m, kv = plan["replicas"], plan["max_num_seqs"], plan["kv_cache_memory_bytes"]
    settings = [r for r in (replicas, replicas - 1) if r >= 1]
    if args.pin and replicas > len(CORES):
        print(f"warning: the plan asks {replicas} replicas and this machine has {len(CORES)} cores: the check cannot "
              f"give each replica its own core as the sweep had, so it is not a fair check", flush=True)
    rows = []
    for rep in range(args.repeats):
        for r in settings:
            server = start_server(args.port, r, ["--max-num-seqs", str(m), "--kv-cache-memory-bytes", str(kv)],
                                  args.pin)
            try:
                before = loadavg()
                res = bench(args, out_dir, f"check_r{r}_{rep}",
                            ["--num-prompts", str(args.check_prompts), "--request-rate", f"{lam:.4f}",
                             "--seed", str(rep)], r)
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
    line = verdict(rows, replicas)
    summary = {"verdict": line, "cpu": cpu, "cores": len(CORES), "pinned": args.pin, "lambda": lam, "users": users,
               "args": vars(args), "sweep": [json.loads(p.read_text()) for p in sweep], "plan": plan, "rows": rows}
    (out_dir / "check.json").write_text(json.dumps(summary, indent=2))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.result_name}.json").write_text(json.dumps(summary, indent=2))
    print(f"saved {RESULTS / (args.result_name + '.json')}")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
