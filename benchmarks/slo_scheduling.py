"""--scheduling-policy slo against fcfs under 3x overload: goodput (requests that met their TTFT and TPOT SLO per
second), sheds, and the longest wait of any request.

Two real servers (the default model, SmolLM2-135M; `--max-num-seqs` small so that overload queues): one fcfs, one
slo. First the capacity: closed-loop clients (as many as --max-num-seqs) on the fcfs server for --capacity-s
seconds give the requests/s it sustains for the prompt/output mix, and its unloaded TTFT/TPOT, from which the
deadlines are set. Then each run offers --overload x that rate (Poisson arrivals, the same schedule for both) to
the fcfs server and to the slo server, interleaved (the order alternates between runs), --duration seconds of
arrivals each. The mix: tight requests (priority 0, TTFT 4x the closed-loop request time, TPOT 3x its TPOT), loose
ones (priority 1, TTFT 12x, TPOT 6x: margins for a shared machine whose speed varies 2-5x), and requests without a
deadline (priority 2: the aging bound covers them). fcfs gets no deadline or priority fields (it refuses them); the
client judges both servers by the same deadlines. After the arrivals, requests still open when no deadline could
still be met are closed (counted as missed).

    PYTHONPATH=src .venv/bin/python benchmarks/slo_scheduling.py --runs 3 --duration 60

Prints one JSON line per run and variant, and a table of medians; every line carries the load average."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time

import httpx

TIGHT, LOOSE, BATCH = "tight", "loose", "batch"


def start_server(port: int, policy: str, args) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", "--port", str(port),
           "--scheduling-policy", policy, "--max-num-seqs", str(args.max_num_seqs),
           "--slo-max-wait-s", str(args.slo_max_wait_s), *args.serve_args.split()]
    if policy != "slo":
        cmd.remove("--slo-max-wait-s")
        cmd.remove(str(args.slo_max_wait_s))
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server on {url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def send(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int,
               slo_fields: dict | None) -> dict:
    """One streamed completion: {"ttft", "tpot", "tokens", "shed", "error", "end"} (times from the send)."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **(slo_fields or {})}
    start = time.monotonic()
    result = {"ttft": None, "tpot": None, "tokens": 0, "shed": False, "error": None, "end": None}
    first = last = None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            error = json.loads(await response.aread()).get("error", {})
            result.update(shed=error.get("code") == "slo_unattainable", error=error.get("code") or "http",
                          end=time.monotonic() - start)
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                result.update(shed=chunk["error"].get("code") == "slo_unattainable",
                              error=chunk["error"].get("code") or "stream")
                break
            if chunk.get("choices"):
                now = time.monotonic()
                first = first if first is not None else now
                last = now
            if chunk.get("usage"):
                result["tokens"] = chunk["usage"]["completion_tokens"]
    result["end"] = time.monotonic() - start
    if first is not None:
        result["ttft"] = first - start
        if result["tokens"] > 1:
            result["tpot"] = (last - first) / (result["tokens"] - 1)
    return result


def make_prompt(rng: random.Random, input_len: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(rng.randint(input_len // 2, input_len * 3 // 2))]


async def capacity(url: str, model: str, args) -> dict:
    """Closed loop, max_num_seqs clients: requests/s sustained, and the median TTFT, TPOT and request time."""
    rng = random.Random(12345)
    results = []
    stop = time.monotonic() + args.capacity_s
    async with httpx.AsyncClient(timeout=None) as client:
        await send(client, url, model, make_prompt(rng, args.input_len), 4, None)  # warm-up

        async def worker() -> None:
            while time.monotonic() < stop:
                results.append(await send(client, url, model, make_prompt(rng, args.input_len), args.output_len,
                                          None))

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(args.max_num_seqs)))
        elapsed = time.monotonic() - start
    done = [r for r in results if r["ttft"] is not None and r["tpot"] is not None]
    return {"rate": len(done) / elapsed, "ttft": statistics.median(r["ttft"] for r in done),
            "tpot": statistics.median(r["tpot"] for r in done), "e2e": statistics.median(r["end"] for r in done)}


async def warm_up(url: str, model: str, args) -> None:
    rng = random.Random(7)
    async with httpx.AsyncClient(timeout=None) as client:
        await asyncio.gather(*(send(client, url, model, make_prompt(rng, args.input_len), 4, None)
                               for _ in range(args.max_num_seqs)))


def workload(seed: int, rate: float, args, slos: dict) -> list[tuple[float, str, list[int]]]:
    """(arrival offset, class, prompt): Poisson arrivals at `rate` for args.duration seconds."""
    rng = random.Random(seed)
    items, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= args.duration:
            return items
        u = rng.random()
        kind = TIGHT if u < args.tight_share else BATCH if u > 1 - args.batch_share else LOOSE
        items.append((t, kind, make_prompt(rng, args.input_len)))


async def offer(url: str, model: str, items, slos: dict, with_fields: bool, args) -> dict:
    drain_s = slos[LOOSE]["ttft_slo_ms"] / 1000 + args.output_len * slos[LOOSE]["tpot_slo_ms"] / 1000 + 2
    shed_before = metric(url, "pagedllm:slo_shed_requests_total")
    limits = httpx.Limits(max_connections=4000, max_keepalive_connections=4000)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.monotonic()

        async def one(offset: float, kind: str, prompt: list[int]) -> dict:
            await asyncio.sleep(max(offset - (time.monotonic() - start), 0))
            fields = dict(slos.get(kind, {}), priority={TIGHT: 0, LOOSE: 1, BATCH: 2}[kind]) if with_fields else None
            sent = time.monotonic()
            try:
                result = await send(client, url, model, prompt, args.output_len, fields)
            except asyncio.CancelledError:
                result = {"ttft": None, "tpot": None, "tokens": 0, "shed": False, "error": "unfinished", "end": None}
            result.update(kind=kind, sent=sent - start)
            return result

        tasks = [asyncio.create_task(one(*item)) for item in items]
        await asyncio.wait(tasks, timeout=args.duration + drain_s)
        cutoff = time.monotonic() - start
        for task in tasks:
            task.cancel()
        results = [await task for task in tasks]
    for r in results:
        if r["error"] == "unfinished":
            r["end"] = cutoff - r["sent"]
    good = [r for r in results if r["kind"] != BATCH and r["ttft"] is not None and r["tpot"] is not None
            and r["tokens"] == args.output_len and r["ttft"] <= slos[r["kind"]]["ttft_slo_ms"] / 1000
            and r["tpot"] <= slos[r["kind"]]["tpot_slo_ms"] / 1000]
    waits = [r["ttft"] if r["ttft"] is not None else r["end"] for r in results]
    batch_waits = [w for w, r in zip(waits, results, strict=True) if r["kind"] == BATCH]
    time.sleep(1)  # the engine's last stats reach /metrics
    return {
        "offered": len(results), "deadline_requests": sum(r["kind"] != BATCH for r in results),
        "goodput": len(good) / args.duration,
        "goodput_with_no_deadline": (len(good) + sum(r["kind"] == BATCH and r["tokens"] == args.output_len
                                                     for r in results)) / args.duration,
        "good_tight": sum(r["kind"] == TIGHT for r in good), "good_loose": sum(r["kind"] == LOOSE for r in good),
        "shed": sum(r["shed"] for r in results),
        "shed_metric": metric(url, "pagedllm:slo_shed_requests_total") - shed_before,
        "unfinished": sum(r["error"] == "unfinished" for r in results),
        "completed": sum(r["tokens"] == args.output_len for r in results),
        "other_errors": sum(r["error"] not in (None, "unfinished") and not r["shed"] for r in results),
        "batch_done": sum(r["kind"] == BATCH and r["tokens"] == args.output_len for r in results),
        "max_wait_s": max(waits), "max_batch_wait_s": max(batch_waits, default=0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run and variant")
    parser.add_argument("--capacity-s", type=float, default=20.0)
    parser.add_argument("--overload", type=float, default=3.0)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=64, help="prompts of 0.5x to 1.5x this many tokens")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--tight-share", type=float, default=0.4)
    parser.add_argument("--batch-share", type=float, default=0.15)
    parser.add_argument("--slo-max-wait-s", type=float, default=30.0, help="the slo server's (30: the default)")
    parser.add_argument("--ports", type=int, nargs=2, default=[8311, 8312])
    parser.add_argument("--serve-args", default="--max-model-len 512 --kv-cache-memory 256MiB")
    parser.add_argument("--out", default=None, help="also write every row to this JSON file")
    parser.add_argument("--capacity", type=float, default=None,
                        help="skip the measure: requests/s, with --base-e2e and --base-tpot (seconds)")
    parser.add_argument("--base-e2e", type=float, default=None)
    parser.add_argument("--recapacity-s", type=float, default=0.0,
                        help="measure the capacity again for this many seconds before each run (0: once)")
    parser.add_argument("--base-tpot", type=float, default=None)
    args = parser.parse_args()
    urls = {policy: f"http://127.0.0.1:{port}" for policy, port in zip(("fcfs", "slo"), args.ports, strict=True)}
    procs = {policy: start_server(port, policy, args) for policy, port in zip(("fcfs", "slo"), args.ports,
                                                                               strict=True)}
    rows = []
    try:
        for policy, proc in procs.items():
            wait_healthy(urls[policy], proc)
        model = httpx.get(urls["fcfs"] + "/v1/models", timeout=10).json()["data"][0]["id"]
        if args.capacity is None:
            cap = asyncio.run(capacity(urls["fcfs"], model, args))
        else:
            cap = {"rate": args.capacity, "e2e": args.base_e2e, "tpot": args.base_tpot, "ttft": None}
        slos = {TIGHT: {"ttft_slo_ms": 4000 * cap["e2e"], "tpot_slo_ms": 3000 * cap["tpot"]},
                LOOSE: {"ttft_slo_ms": 12000 * cap["e2e"], "tpot_slo_ms": 6000 * cap["tpot"]}}
        print(json.dumps({"capacity": cap, "slos": slos, "loadavg": os.getloadavg()[0]}), flush=True)
        rate = args.overload * cap["rate"]
        for policy in ("fcfs", "slo"):  # warm-up: the slo server measures its steps
            asyncio.run(warm_up(urls[policy], model, args))
        for run in range(args.runs):
            if args.recapacity_s > 0:  # the shared machine's speed drifts: 3x of what it sustains now
                now_cap = asyncio.run(capacity(urls["fcfs"], model,
                                               argparse.Namespace(**{**vars(args), "capacity_s": args.recapacity_s})))
                rate = args.overload * now_cap["rate"]
                print(json.dumps({"run": run, "capacity_now": now_cap, "loadavg": os.getloadavg()[0]}), flush=True)
            items = workload(1000 + run, rate, args, slos)
            order = ("fcfs", "slo") if run % 2 == 0 else ("slo", "fcfs")
            for policy in order:
                load = os.getloadavg()[0]
                row = asyncio.run(offer(urls[policy], model, items, slos, policy == "slo", args))
                row.update(policy=policy, run=run, rate=rate, loadavg_start=load, loadavg_end=os.getloadavg()[0])
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        for proc in procs.values():
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"capacity": cap, "slos": slos, "rows": rows}, f, indent=1)
    keys = ("goodput", "goodput_with_no_deadline", "shed", "unfinished", "max_wait_s", "max_batch_wait_s",
            "batch_done", "loadavg_start")
    print("| policy | goodput (req/s) | with no-deadline done | shed | unfinished | max wait (s) | "
          "max wait, no deadline (s) | no-deadline done | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    med = {}
    for policy in ("fcfs", "slo"):
        mine = [r for r in rows if r["policy"] == policy]
        med[policy] = {k: statistics.median(r[k] for r in mine) for k in keys}
        m = med[policy]
        print(f"| {policy} | {m['goodput']:.2f} | {m['goodput_with_no_deadline']:.2f} | {m['shed']:.0f} | "
              f"{m['unfinished']:.0f} | {m['max_wait_s']:.1f} | "
              f"{m['max_batch_wait_s']:.1f} | {m['batch_done']:.0f} | {m['loadavg_start']:.1f} |")
    ratios = [s["goodput"] / f["goodput"] if f["goodput"] else float("inf")
              for f, s in zip([r for r in rows if r["policy"] == "fcfs"], [r for r in rows if r["policy"] == "slo"],
                              strict=True)]
    print(f"goodput slo / fcfs per run: {', '.join(f'{x:.2f}' for x in ratios)}; "
          f"median of medians {med['slo']['goodput'] / max(med['fcfs']['goodput'], 1e-9):.2f}")


if __name__ == "__main__":
    main()
