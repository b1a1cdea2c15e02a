"""Where the CPU goes per streamed output token when serving: API server, engine core (by thread), client.

Starts `pagedllm serve` (or measures one already running: --server-pid), warms it up, then per concurrency runs
`pagedllm bench serve` (random prompts, ignore_eos, streaming) and reads utime+stime from /proc before and
after: the API-server process, each engine-core thread (main = schedule + model step + update; engine-output =
msgspec encode + ZMQ send; engine-input; ZMQbg/* = libzmq's IO threads; the rest = OpenMP workers and other
native threads) and the client (its rusage). Prints CPU ms per output token per process, output tok/s and the
ITL median.

    PYTHONPATH=src python benchmarks/serving_cpu.py --concurrency 16 64 --num-prompts 64
    PAGEDLLM_API_PROFILE=/tmp/api.prof python benchmarks/serving_cpu.py ...   # plus a cProfile of the API
                                                                              # server's event loop thread

Run it on a quiet machine (it prints the load average before and after): every process shares the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat_cpu_s(path: str) -> tuple[str, float]:
    """(comm, utime + stime in seconds) of /proc/.../stat."""
    with open(path) as f:
        text = f.read()
    comm = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    return comm, (int(fields[11]) + int(fields[12])) * _TICK_S


def process_cpu_s(pid: int) -> float:
    return _stat_cpu_s(f"/proc/{pid}/stat")[1]


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread group of a process: "main", each named thread, "other" for unnamed native threads
    (their comm is the process's own)."""
    process_comm = _stat_cpu_s(f"/proc/{pid}/stat")[0]
    result: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm, cpu_s = _stat_cpu_s(f"/proc/{pid}/task/{tid}/stat")
        except OSError:  # the thread ended
            continue
        if int(tid) == pid:
            group = "main"
        elif comm.startswith("ZMQbg"):
            group = "ZMQbg/*"
        elif comm == process_comm:
            group = "other"
        else:
            group = comm
        result[group] = result.get(group, 0.0) + cpu_s
    return result


def child_pids(pid: int) -> list[int]:
    children = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            children.extend(int(c) for c in f.read().split())
    return children


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


def run_client(args, concurrency: int, num_prompts: int, output_len: int, result_dir: str,
               seed: int) -> tuple[dict, float]:
    """One `pagedllm bench serve` run; returns its result JSON and the client's CPU seconds."""
    name = f"c{concurrency}-{seed}.json"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "bench", "serve", "--port", str(args.port),
           "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
           str(output_len), "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
           "--ignore-eos", "--disable-tqdm", "--seed", str(seed), "--save-result", "--result-dir", result_dir,
           "--result-filename", name, "--tokenizer", args.tokenizer]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL if args.quiet else None)
    _, status, rusage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"bench serve failed ({proc.returncode})")
    with open(os.path.join(result_dir, name)) as f:
        return json.load(f), rusage.ru_utime + rusage.ru_stime


def measure(args, server_pid: int, core_pid: int, concurrency: int, result_dir: str, seed: int) -> dict:
    server0, core0 = process_cpu_s(server_pid), thread_cpu_s(core_pid)
    server_threads0 = thread_cpu_s(server_pid)
    load0 = os.getloadavg()[0]
    result, client_s = run_client(args, concurrency, args.num_prompts, args.output_len, result_dir, seed)
    server_s = process_cpu_s(server_pid) - server0
    server_threads = {k: v - server_threads0.get(k, 0.0) for k, v in thread_cpu_s(server_pid).items()}
    core = {k: v - core0.get(k, 0.0) for k, v in thread_cpu_s(core_pid).items()}
    tokens = result["total_output_tokens"]
    ms = 1000.0 / tokens
    return {
        "concurrency": concurrency, "output_tokens": tokens, "output_tok_s": result["output_throughput"],
        "median_itl_ms": result["median_itl_ms"], "load_before": load0, "load_after": os.getloadavg()[0],
        "api_server_ms_per_tok": server_s * ms,
        "api_server_threads_ms_per_tok": {k: v * ms for k, v in sorted(server_threads.items()) if v > 0},
        "engine_core_ms_per_tok": sum(core.values()) * ms,
        "engine_core_threads_ms_per_tok": {k: v * ms for k, v in sorted(core.items()) if v > 0},
        "client_ms_per_tok": client_s * ms,
    }


def print_row(row: dict) -> None:
    def fmt(d: dict) -> str:
        return ", ".join(f"{k} {v:.2f}" for k, v in d.items())

    print(f"c{row['concurrency']}: {row['output_tokens']} tokens, {row['output_tok_s']:.1f} output tok/s, "
          f"ITL median {row['median_itl_ms']:.1f} ms, load {row['load_before']:.2f} -> {row['load_after']:.2f}")
    print(f"  CPU ms per output token: API server {row['api_server_ms_per_tok']:.2f} "
          f"({fmt(row['api_server_threads_ms_per_tok'])})")
    print(f"                           engine core {row['engine_core_ms_per_tok']:.2f} "
          f"({fmt(row['engine_core_threads_ms_per_tok'])})")
    print(f"                           client {row['client_ms_per_tok']:.2f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--server-pid", type=int, default=None,
                        help="measure this running API server (on --port) instead of starting one")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="runs per concurrency")
    parser.add_argument("--serve-args", default="--kv-cache-memory 1200MiB --max-model-len 1024 --max-num-seqs 64",
                        help="extra `pagedllm serve` flags (one string)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    parser.add_argument("--quiet", action="store_true", help="hide the client's own summary")
    parser.add_argument("--tokenizer", default=None, help="the client's tokenizer (default: the embedded GGUF)")
    args = parser.parse_args()
    if args.tokenizer is None:
        from pagedllm.models.resolve import resolve_model

        args.tokenizer = str(resolve_model(None).path)

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(1))  # run the finally: stop the server
    proc = None
    if args.server_pid is None:
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", "--port", str(args.port),
               *args.serve_args.split()]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        server_pid = proc.pid
    else:
        server_pid = args.server_pid
    rows = []
    try:
        wait_healthy(f"http://127.0.0.1:{args.port}", 300, proc)
        core_pids = child_pids(server_pid)
        if len(core_pids) != 1:
            raise RuntimeError(f"expected one engine-core child of {server_pid}, found {core_pids}")
        with tempfile.TemporaryDirectory() as result_dir:
            run_client(args, 4, 4, 8, result_dir, seed=99)  # warm-up
            for repeat in range(args.repeats):
                for concurrency in args.concurrency:
                    row = measure(args, server_pid, core_pids[0], concurrency, result_dir, seed=repeat)
                    print_row(row)
                    rows.append(row)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
