"""Load, disconnect-storm and overload benchmark against a real `pagedllm serve` (issue 6, "Load").

    .venv/bin/python benchmarks/load_test.py [--model tiny|PATH] [--url URL] [--duration 600] [--concurrency 128]
        [--storm] [--overload] [--load] [--result-file out.json] [-- EXTRA SERVE FLAGS]

Modes (any combination; none given = --load):
  --load      `--concurrency` clients send mixed requests back to back for `--duration` s: prompt lengths and
              max_tokens mixed, /v1/completions and /v1/chat/completions, streaming and not, some sharing a
              prefix (prefix-cache hits) and some with n=2. Checks: zero 5xx (every response 200, no error event
              in a stream, no client-side exception), API-server RSS growth < 5% from warm-up (the first
              `--warmup-frac` of the run) to the end, open fds of the API server back to their baseline after
              the drain, and after the drain running + waiting == 0, free blocks == total, total_ref_cnt == 0.
              Engine-core RSS is reported, not checked.
  --storm     disconnect storm: `--storm-requests` (1,000) at `--storm-concurrency` (128), 20% of the clients
              closing at a random point (half of them streaming); afterwards running + waiting == 0, free ==
              total, total_ref_cnt == 0, and vllm:request_success_total{finished_reason="abort"} grew by exactly
              the number of closes.
  --overload  against a server with --max-num-seqs 4 --max-num-queued-reqs 16: a wave of 3x its capacity
              (the CI test's shape), then `--overload-duration` s of open-loop (Poisson) arrivals at 3x its
              measured service rate. Checks: the waiting queue never exceeds 16, every excess request gets
              503 `queue_full` with Retry-After, vllm:admission_rejections counts each one, the p99 latency
              of the sustained phase's 503s < `--overload-p99-ms` (50; the issue's figure, over ~2,000
              rejections) and the wave's p99 (of 40: its slowest) < `--overload-wave-p99-ms` (250, as CI).

`--model tiny` builds the tiny random Llama of tests/conftest.py (GGUF, fp32); no --model serves the embedded
SmolLM2-135M-Instruct. Each mode starts its own server (flags after `--` are added to it), unless `--url` names
a running server on this machine (started with --enable-debug-routes; its PIDs are read from /debug/kv_cache).
Prints a summary, writes every figure as JSON to `--result-file`, and exits 1 if any check fails.

tests/reliability/test_load.py runs the same functions at CI size (60 s load, 300-request storm, one wave).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "reliability"), str(ROOT / "tests")]
from reliability_utils import Server, num_fds, rss_bytes, wait_for  # noqa: E402

from server_process import build_tiny_model  # noqa: E402

ABORTS = 'vllm:request_success_total{finished_reason="abort"'
WORDS = ("the quick brown fox jumps over the lazy dog while paged attention stores keys and values in fixed "
         "size blocks so that a language model can predict the next token from the previous ones hello world "
         "numbers like 12345 and 2024 appear in text as do symbols").split()
PREAMBLE = ("You are a careful assistant. Answer briefly and precisely, and say so when you do not know. " * 4).strip()


# ---------------------------------------------------------------------------------------------- the server

class Remote(Server):
    """A running server reached by URL (same kv/metrics/metric helpers as Server; nothing to stop)."""

    def __init__(self, url: str, api_key: str | None = None):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, timeout=30.0)
        self.proc = None
        self._clients, self._client_cache = [], {}

    def close(self) -> None:
        self.http.close()


def ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pids(server) -> tuple[int, int]:
    """(API-server pid, engine-core pid): the engine core is the API server's child."""
    engine = server.engine_pid()
    return ppid(engine), engine


def model_info(server) -> tuple[str, int]:
    """(served model name, max_model_len) from /v1/models."""
    card = server.http.get("/v1/models", headers=server.headers).json()["data"][0]
    return card["id"], card["max_model_len"]


def finished_by_reason(server) -> dict[str, int]:
    """vllm:request_success_total by finished_reason."""
    out: dict[str, int] = {}
    for name, value in server.metrics().items():
        if name.startswith("vllm:request_success_total{") and 'finished_reason="' in name:
            reason = name.split('finished_reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0) + int(value)
    return out


def idle_state(server, timeout_s: float) -> tuple[bool, dict]:
    """Wait up to timeout_s for nothing running, waiting or open, every block free and every ref_cnt 0."""
    def idle() -> bool:
        try:
            kv = server.kv()
            return (kv["num_running_reqs"] + kv["num_waiting_reqs"] + kv["num_open_requests"] == 0
                    and kv["num_free_blocks"] == kv["num_total_blocks"] and kv["total_ref_cnt"] == 0)
        except (httpx.HTTPError, KeyError, ValueError):  # /debug/kv_cache times out while a step is long
            return False
    ok = wait_for(idle, timeout_s, 0.05)
    return ok, server.kv()


def idle_failures(kv: dict) -> list[str]:
    failures = []
    if kv["num_running_reqs"] + kv["num_waiting_reqs"] != 0:
        failures.append(f"running + waiting = {kv['num_running_reqs'] + kv['num_waiting_reqs']} after the drain")
    if kv["num_open_requests"] != 0:
        failures.append(f"{kv['num_open_requests']} requests still open in the API server after the drain")
    if kv["num_free_blocks"] != kv["num_total_blocks"]:
        failures.append(f"free blocks {kv['num_free_blocks']} != total {kv['num_total_blocks']} after the drain")
    if kv["total_ref_cnt"] != 0:
        failures.append(f"total_ref_cnt {kv['total_ref_cnt']} != 0 after the drain")
    return failures




# ------------------------------------------------------------------------------------------ one request

async def sse_lines(response: httpx.Response):
    """The lines of an SSE stream, split as the SSE spec says: at CR LF, LF or CR only. (httpx's aiter_lines
    splits like str.splitlines, also at U+0085, U+2028, U+2029, ... which JSON carries unescaped, so a
    generated text holding one of them would cut a `data:` line in two.)"""
    buffer = ""
    async for text in response.aiter_text():
        buffer += text
        *lines, buffer = buffer.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        for line in lines:
            yield line
    if buffer:
        yield buffer


async def stream_request(client: httpx.AsyncClient, path: str, body: dict, headers: dict | None = None,
                         stop_after_chunks: int = 0) -> dict:
    """POST a streaming request and read its SSE events. Returns status, text, finish reasons, chunks and
    error events; with stop_after_chunks > 0 the client closes the connection after that many chunks."""
    out = {"status": 0, "text": "", "reasons": [], "chunks": 0, "errors": [], "done": False, "closed": False}
    async with client.stream("POST", path, json={**body, "stream": True}, headers=headers) as response:
        out["status"] = response.status_code
        if response.status_code != 200:
            out["body"] = (await response.aread()).decode(errors="replace")[:500]
            return out
        async for line in sse_lines(response):
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["errors"].append(chunk["error"])
                    continue
                out["chunks"] += 1
                for choice in chunk.get("choices", []):
                    out["text"] += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if choice.get("finish_reason"):
                        out["reasons"].append(choice["finish_reason"])
                if stop_after_chunks and out["chunks"] >= stop_after_chunks:
                    out["closed"] = True
                    return out
    return out


async def plain_request(client: httpx.AsyncClient, path: str, body: dict, headers: dict | None = None) -> dict:
    response = await client.post(path, json=body, headers=headers)
    out = {"status": response.status_code, "reasons": [], "errors": [], "done": True, "closed": False}
    try:
        payload = response.json()
    except ValueError:
        payload = {}
    if response.status_code == 200:
        out["reasons"] = [c["finish_reason"] for c in payload.get("choices", [])]
        out["tokens"] = payload.get("usage", {}).get("completion_tokens", 0)
    else:
        out["body"] = response.text[:500]
        out["retry_after"] = response.headers.get("retry-after")
        out["code"] = (payload.get("error") or {}).get("code") if isinstance(payload, dict) else None
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# ------------------------------------------------------------------------------------------------- load

class Workload:
    """Mixed requests: prompts of measured token lengths (log-uniform, 4 .. max_model_len/4, at most 1024),
    half of the completions behind a shared preamble; max_tokens mostly short, some long, always fitting
    max_model_len; both endpoints, streaming or not, greedy or sampled, ignore_eos or not, a few with n=2."""

    MARGIN = 16  # tokens for the per-request tag appended to a prompt

    def __init__(self, server, model: str, max_model_len: int, seed: int = 0, pool_size: int = 48):
        self.model, self.max_model_len = model, max_model_len
        self.rng = random.Random(seed)
        top = max(8, min(1024, max_model_len // 4))
        self.pool = []  # (text, completion prompt tokens, chat prompt tokens, token ids)
        for i in range(pool_size):
            target = int(round(4 * (top / 4) ** (i / max(1, pool_size - 1))))
            words = self._words(target)
            text = (PREAMBLE + " " + words) if i % 2 else words
            tok = server.http.post("/tokenize", headers=server.headers,
                                   json={"model": model, "prompt": text}).json()
            chat = server.http.post("/tokenize", headers=server.headers,
                                    json={"model": model, "messages": [{"role": "user", "content": text}]}).json()
            if max(tok["count"], chat["count"]) + self.MARGIN + 1 < max_model_len:
                self.pool.append((text, tok["count"], chat["count"], tok["tokens"]))
        self.n = 0

    def _words(self, num_tokens: int) -> str:
        # Roughly one token or more per word: enough words, then the tokenizer measures the real length.
        return " ".join(self.rng.choice(WORDS) for _ in range(max(1, num_tokens)))

    def next(self) -> tuple[str, dict, bool]:
        """(path, body, stream) of the next request."""
        rng = self.rng
        self.n += 1
        text, completion_len, chat_len, token_ids = rng.choice(self.pool)
        chat = rng.random() < 0.5
        stream = rng.random() < 0.5
        room = self.max_model_len - max(completion_len, chat_len) - self.MARGIN
        r = rng.random()
        wanted = rng.randint(1, 16) if r < 0.4 else rng.randint(16, 64) if r < 0.8 else rng.randint(64, 256)
        body = {"model": self.model, "max_tokens": max(1, min(wanted, room)),
                "temperature": rng.choice([0.0, 0.7, 1.0]), "ignore_eos": rng.random() < 0.5}
        if rng.random() < 0.1:
            body["n"] = 2
        tag = f" (request {self.n})"
        if chat:
            body["messages"] = [{"role": "user", "content": text + tag}]
            return "/v1/chat/completions", body, stream
        if rng.random() < 0.2 and not stream:
            body["prompt"] = token_ids  # token ids, measured by /tokenize, so in the vocabulary
        else:
            body["prompt"] = text + tag
        return "/v1/completions", body, stream


def _sample_memory(api_pid: int, engine_pid: int, start: float, samples: list, stop: threading.Event,
                   interval_s: float) -> None:
    """RSS samples every interval_s until `stop`, in a thread of its own: in the event loop, 128 clients kept
    it from running for more than the 1.5 s of a 30 s run's measuring windows on a loaded machine (no sample,
    a growth of nan)."""
    while True:
        try:
            samples.append((time.monotonic() - start, rss_bytes(api_pid), rss_bytes(engine_pid)))
        except (OSError, RuntimeError):
            pass
        if stop.wait(interval_s):
            return


def run_load(server, duration_s: float = 600.0, concurrency: int = 128, warmup_frac: float = 0.1,
             seed: int = 0, max_rss_growth: float = 0.05, progress: bool = False) -> tuple[dict, list[str]]:
    """Drive `server` for duration_s at `concurrency` mixed requests; returns (figures, failed checks)."""
    model, max_model_len = model_info(server)
    workload = Workload(server, model, max_model_len, seed)
    api_pid, engine_pid = pids(server)

    # Baseline: one request of each kind first (lazy imports, first-use allocations), then idle.
    async def warm() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120, headers=server.headers) as client:
            for path in ("/v1/completions", "/v1/chat/completions"):
                key = "prompt" if path == "/v1/completions" else "messages"
                value = "hello" if key == "prompt" else [{"role": "user", "content": "hello"}]
                await plain_request(client, path, {"model": model, key: value, "max_tokens": 4})
                await stream_request(client, path, {"model": model, key: value, "max_tokens": 4})
    asyncio.run(warm())
    idle_state(server, 10.0)
    time.sleep(0.5)  # let the warm-up's closed connections be reaped
    fds_before = num_fds(api_pid)
    rss_api_idle, rss_engine_idle = rss_bytes(api_pid), rss_bytes(engine_pid)

    statuses: Counter = Counter()
    failures_seen: Counter = Counter()
    examples: list = []
    kinds: Counter = Counter()
    latencies: list[float] = []
    samples: list = []
    out_tokens = 0

    async def drive() -> tuple[float, float]:
        nonlocal out_tokens
        start = time.monotonic()
        deadline = start + duration_s
        stop = threading.Event()
        sampler = threading.Thread(target=_sample_memory, args=(api_pid, engine_pid, start, samples, stop,
                                                                max(0.25, min(2.0, duration_s / 300))), daemon=True)
        sampler.start()
        # No keep-alive: a new connection per request. With kept-alive connections a 10-minute run saw 7
        # ReadErrors in 12,000 requests, none of which reached a handler (the server's log): the server
        # closing a connection idle for its 5 s keep-alive timeout just as the client reused it, the usual
        # HTTP/1.1 race, which says nothing about the server. One connection per request also makes the fd
        # check see every connection's socket closed.
        limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits,
                                     headers=server.headers) as client:
            async def worker() -> None:
                nonlocal out_tokens
                while time.monotonic() < deadline:
                    path, body, stream = workload.next()
                    kind = path.removeprefix("/v1/").replace("/", "-") + ("-stream" if stream else "")
                    t0 = time.monotonic()
                    try:
                        result = await (stream_request(client, path, body) if stream
                                        else plain_request(client, path, body))
                    except Exception as e:  # a client-side failure is a failure of the server too
                        statuses[f"exception:{type(e).__name__}"] += 1
                        failures_seen["exception"] += 1
                        if len(examples) < 10:
                            examples.append({"kind": kind, "exception": repr(e)})
                        continue
                    latencies.append(time.monotonic() - t0)
                    statuses[str(result["status"])] += 1
                    kinds[kind] += 1
                    out_tokens += result.get("tokens", result.get("chunks", 0))
                    problem = None
                    if result["status"] != 200:
                        problem = "status"
                    elif result["errors"]:
                        problem = "stream error event"
                    elif not result["done"]:
                        problem = "stream without [DONE]"
                    elif len(result["reasons"]) != body.get("n", 1):
                        problem = "missing finish_reason"
                    if problem:
                        failures_seen[problem] += 1
                        if len(examples) < 10:
                            examples.append({"kind": kind, "problem": problem, "body": body,
                                             "result": {k: v for k, v in result.items() if k != "text"}})

            async def report() -> None:
                while time.monotonic() < deadline:
                    await asyncio.sleep(min(30.0, max(5.0, duration_s / 20)))
                    try:
                        kv = (await client.get("/debug/kv_cache")).json()
                        kv["num_running_reqs"]
                    except (httpx.HTTPError, KeyError, ValueError):
                        kv = {"num_running_reqs": -1, "num_waiting_reqs": -1}  # the engine was busy
                    print(f"  t={time.monotonic() - start:6.0f} s  requests {sum(statuses.values()):7d}  "
                          f"running {kv['num_running_reqs']:3d} waiting {kv['num_waiting_reqs']:3d}  "
                          f"API RSS {rss_bytes(api_pid) / 2**20:7.1f} MiB  engine RSS "
                          f"{rss_bytes(engine_pid) / 2**20:7.1f} MiB  fds {num_fds(api_pid)}", flush=True)

            reporter = asyncio.ensure_future(report()) if progress else None
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            end = time.monotonic()
            if reporter:
                reporter.cancel()
        stop.set()
        sampler.join()
        return start, end

    cpu_before = (cpu_seconds(api_pid), cpu_seconds(engine_pid), sum(os.times()[:2]))
    start, end = asyncio.run(drive())
    cpu = [b - a for a, b in zip(cpu_before, (cpu_seconds(api_pid), cpu_seconds(engine_pid), sum(os.times()[:2])),
                                 strict=True)]
    load_s = max(duration_s, 1e-9)
    drain_s = end - start - duration_s
    idle, kv = idle_state(server, 30.0)
    fds_ok = wait_for(lambda: num_fds(api_pid) <= fds_before, 10.0, 0.1)
    fds_after = num_fds(api_pid)
    rss_api_drained, rss_engine_drained = rss_bytes(api_pid), rss_bytes(engine_pid)

    # RSS under load: the peak in the window just after the warm-up vs the peak in the last 5% of the run
    # (peaks, not single samples: the working set moves with the requests in flight at that instant).
    warm_from, warm_to = warmup_frac * load_s, (warmup_frac + 0.05) * load_s
    in_warm = [s for s in samples if warm_from <= s[0] <= warm_to]
    at_end = [s for s in samples if 0.95 * load_s <= s[0] <= load_s]
    rss_api_warm = max(s[1] for s in in_warm) if in_warm else float("nan")
    rss_api_end = max(s[1] for s in at_end) if at_end else float("nan")
    rss_engine_warm = max(s[2] for s in in_warm) if in_warm else float("nan")
    rss_engine_end = max(s[2] for s in at_end) if at_end else float("nan")
    growth = rss_api_end / rss_api_warm - 1
    engine_growth = rss_engine_end / rss_engine_warm - 1
    five_xx = sum(n for code, n in statuses.items() if code.isdigit() and int(code) >= 500)
    total = sum(statuses.values())

    figures = {
        "mode": "load", "model": model, "max_model_len": max_model_len, "duration_s": duration_s,
        "concurrency": concurrency, "warmup_frac": warmup_frac, "seed": seed,
        "requests": total, "requests_per_s": total / load_s, "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / load_s, "drain_s": drain_s,
        "status_counts": dict(statuses), "num_5xx": five_xx, "problems": dict(failures_seen),
        "problem_examples": examples, "requests_by_kind": dict(kinds),
        "latency_p50_s": percentile(latencies, 0.5), "latency_p99_s": percentile(latencies, 0.99),
        "api_pid": api_pid, "engine_pid": engine_pid,
        "api_rss_idle_before_mib": rss_api_idle / 2**20, "api_rss_warmup_mib": rss_api_warm / 2**20,
        "api_rss_end_mib": rss_api_end / 2**20, "api_rss_growth_pct": 100 * growth,
        "api_rss_after_drain_mib": rss_api_drained / 2**20,
        "engine_rss_idle_before_mib": rss_engine_idle / 2**20, "engine_rss_warmup_mib": rss_engine_warm / 2**20,
        "engine_rss_end_mib": rss_engine_end / 2**20, "engine_rss_growth_pct": 100 * engine_growth,
        "engine_rss_after_drain_mib": rss_engine_drained / 2**20,
        "cpu_s": {"api_server": cpu[0], "engine_core": cpu[1], "client": cpu[2], "wall": end - start},
        "loadavg_end": os.getloadavg(),
        "api_fds_before": fds_before, "api_fds_after": fds_after, "kv_after_drain": kv,
        "rss_samples": [(round(t, 2), a, e) for t, a, e in samples],
    }
    failures = []
    if five_xx:
        failures.append(f"{five_xx} responses were 5xx")
    if total == 0:
        failures.append("no request completed")
    if failures_seen:
        failures.append(f"failed requests: {dict(failures_seen)}")
    if not growth < max_rss_growth:
        failures.append(f"API-server RSS grew {100 * growth:.2f}% after warm-up (limit {100 * max_rss_growth:.0f}%)")
    if not fds_ok:
        failures.append(f"API-server fds {fds_after} after the drain, baseline {fds_before}")
    if not idle:
        failures += idle_failures(kv) or ["the server did not return to idle"]
    return figures, failures


def summarize_load(f: dict) -> str:
    return (f"load: {f['requests']} requests in {f['duration_s']:.0f} s at concurrency {f['concurrency']} "
            f"({f['requests_per_s']:.1f} req/s, {f['output_tokens_per_s']:.0f} output tok/s, "
            f"drain {f['drain_s']:.1f} s); "
            f"statuses {f['status_counts']}, 5xx {f['num_5xx']}, problems {f['problems'] or 'none'}; "
            f"latency p50 {f['latency_p50_s']:.2f} s p99 {f['latency_p99_s']:.2f} s; CPU s: API server "
            f"{f['cpu_s']['api_server']:.0f}, engine core {f['cpu_s']['engine_core']:.0f}, client "
            f"{f['cpu_s']['client']:.0f} in {f['cpu_s']['wall']:.0f} s\n"
            f"  API-server RSS: idle {f['api_rss_idle_before_mib']:.1f} MiB, warm-up {f['api_rss_warmup_mib']:.1f}, "
            f"end {f['api_rss_end_mib']:.1f} (growth {f['api_rss_growth_pct']:+.2f}%), "
            f"after drain {f['api_rss_after_drain_mib']:.1f}\n"
            f"  engine-core RSS: idle {f['engine_rss_idle_before_mib']:.1f} MiB, warm-up "
            f"{f['engine_rss_warmup_mib']:.1f}, end {f['engine_rss_end_mib']:.1f} "
            f"(growth {f['engine_rss_growth_pct']:+.2f}%), after drain {f['engine_rss_after_drain_mib']:.1f}\n"
            f"  API-server fds: before {f['api_fds_before']}, after drain {f['api_fds_after']}; after drain: "
            f"running {f['kv_after_drain']['num_running_reqs']} waiting {f['kv_after_drain']['num_waiting_reqs']} "
            f"free blocks {f['kv_after_drain']['num_free_blocks']}/{f['kv_after_drain']['num_total_blocks']} "
            f"total_ref_cnt {f['kv_after_drain']['total_ref_cnt']}")


# ------------------------------------------------------------------------------------- disconnect storm

def run_storm(server, num_requests: int = 1000, concurrency: int = 128, close_frac: float = 0.2,
              seed: int = 1) -> tuple[dict, list[str]]:
    """num_requests at `concurrency`, close_frac of the clients closing at a random point (half of them
    streaming: after 1-10 chunks; the others after 0.5-2 s without an answer). Requests alternate between
    the two endpoints. Returns (figures, failed checks).

    A client that closes before the server has even received its request (a non-streaming one, on a
    server too busy to read it within 0.5 s) leaves nothing to abort. Where the server's log is at hand
    (a server this script started), the check is that every close whose request the log shows received
    was counted as an abort (and the closes that never reached the server are reported); else that the
    aborts equal the closes."""
    model, _ = model_info(server)
    rng = random.Random(seed)
    run_id = os.urandom(4).hex()
    aborts_before = server.metric(ABORTS)
    finished_before = finished_by_reason(server)
    closes = {"stream": 0, "plain": 0}
    closed_ids: list[str] = []
    statuses: Counter = Counter()
    problems: list = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        closer, stream = rng.random() < close_frac, i % 2 == 0
        path = "/v1/completions" if i % 4 < 2 else "/v1/chat/completions"
        body = {"model": model, "ignore_eos": True, "max_tokens": 400 if closer else 8,
                "request_id": f"storm-{run_id}-{i}"}
        if path == "/v1/completions":
            body["prompt"] = f"request {i} says hello"
        else:
            body["messages"] = [{"role": "user", "content": f"request {i} says hello"}]
        if not closer:
            result = await (stream_request(client, path, body) if stream else plain_request(client, path, body))
            statuses[str(result["status"])] += 1
            if result["status"] != 200 or result["errors"] or result["reasons"] != ["length"]:
                problems.append({"i": i, **{k: v for k, v in result.items() if k != "text"}})
            return
        if stream:  # close after a random number of chunks
            result = await stream_request(client, path, body, stop_after_chunks=rng.randint(1, 10))
            statuses[str(result["status"])] += 1
            if result["closed"]:
                closes["stream"] += 1
                closed_ids.append(body["request_id"])
            else:
                problems.append({"i": i, "closer": True, **{k: v for k, v in result.items() if k != "text"}})
            return
        try:  # close at a random time; a response that came first is no close
            result = await asyncio.wait_for(plain_request(client, path, body), rng.uniform(0.5, 2.0))
            statuses[str(result["status"])] += 1
        except TimeoutError:
            closes["plain"] += 1
            closed_ids.append(body["request_id"])

    async def storm() -> None:
        semaphore = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits,
                                     headers=server.headers) as client:
            async def bounded(i: int) -> None:
                async with semaphore:
                    await one(client, i)
            await asyncio.gather(*(bounded(i) for i in range(num_requests)))

    start = time.monotonic()
    asyncio.run(storm())
    elapsed = time.monotonic() - start
    idle, kv = idle_state(server, 10.0)
    idle_after_s = time.monotonic() - start - elapsed
    num_closes = closes["stream"] + closes["plain"]
    log = server.log() if getattr(server, "log_path", None) else None
    if log is not None:  # "Received request cmpl-storm-...-<8 hex>: ..." once the request is handed to the engine
        # the engine id is the response id plus a random suffix (serving_base.add_requests): drop both ends
        received = {line.split("Received request ", 1)[1].split(":", 1)[0].split("-", 1)[1].rsplit("-", 1)[0]
                    for line in log.splitlines() if "Received request " in line and f"storm-{run_id}-" in line}
        expected_aborts = sum(request_id in received for request_id in closed_ids)
    else:
        expected_aborts = num_closes
    wait_for(lambda: server.metric(ABORTS) - aborts_before == expected_aborts, 5.0, 0.1)
    aborts = int(server.metric(ABORTS) - aborts_before)
    healthy = server.http.get("/health").status_code == 200
    finished = {k: v - finished_before.get(k, 0) for k, v in finished_by_reason(server).items()}
    figures = {"mode": "storm", "model": model, "requests": num_requests, "concurrency": concurrency,
               "close_frac": close_frac, "seed": seed, "elapsed_s": elapsed, "closes": num_closes,
               "closes_streaming": closes["stream"], "closes_plain": closes["plain"],
               "closes_before_received": num_closes - expected_aborts if log is not None else None,
               "aborts_expected": expected_aborts, "aborts": aborts,
               "finished_by_reason": {k: v for k, v in finished.items() if v}, "idle_after_s": idle_after_s,
               "status_counts": dict(statuses), "problems": problems[:10], "num_problems": len(problems),
               "kv_after": kv, "healthy_after": healthy}
    failures = []
    if num_closes == 0:
        failures.append("no client closed")
    # A plain (non-streaming) close can come after its 400 tokens were done: the engine counted the request as
    # `length` and there was nothing to abort. Every request ends once, so those are the extra lengths.
    finished_first = max(finished.get("length", 0) - (num_requests - num_closes), 0)
    figures["closes_after_finish"] = finished_first
    # (how many depends on the machine's speed against the clients' random close points: 5 of 49 with both cores
    # busy with other work; what must hold is the count, and that most closes did interrupt a request)
    if aborts + finished_first != expected_aborts or finished_first > max(2, num_closes // 4):
        failures.append(f"{aborts} aborts counted for {num_closes} closes, {expected_aborts} of them of requests "
                        f"the server had received, {finished_first} of those after their request had finished")
    if problems:
        failures.append(f"{len(problems)} requests that were not closed failed")
    if not idle:
        failures += idle_failures(kv) or ["the server did not return to idle"]
    if not healthy:
        failures.append("/health is not 200 after the storm")
    return figures, failures


def summarize_storm(f: dict) -> str:
    kv = f["kv_after"]
    return (f"storm: {f['requests']} requests at concurrency {f['concurrency']} in {f['elapsed_s']:.1f} s, "
            f"{f['closes']} closes ({f['closes_streaming']} streaming, {f['closes_plain']} not; "
            f"{f['closes_before_received']} before the server received the request), {f['aborts']} aborts "
            f"(expected {f['aborts_expected']}); finished by reason {f['finished_by_reason']}, idle "
            f"{f['idle_after_s']:.1f} s after; "
            f"statuses {f['status_counts']}, problems {f['num_problems']}; after: running {kv['num_running_reqs']} "
            f"waiting {kv['num_waiting_reqs']} free blocks {kv['num_free_blocks']}/{kv['num_total_blocks']} "
            f"total_ref_cnt {kv['total_ref_cnt']}, /health {'200' if f['healthy_after'] else 'not 200'}")


# --------------------------------------------------------------------------------------------- overload

OVERLOAD_PROMPT = "The quick brown fox jumps over the lazy dog"


async def _watch_waiting(client: httpx.AsyncClient, state: dict) -> None:
    while not state["done"]:
        kv = (await client.get("/debug/kv_cache")).json()
        state["max_waiting"] = max(state["max_waiting"], kv["num_waiting_reqs"])
        await asyncio.sleep(0.05)


async def _timed(client: httpx.AsyncClient, body: dict) -> dict:
    t0 = time.monotonic()
    result = await plain_request(client, "/v1/completions", body)
    result["end_s"] = time.monotonic()
    result["latency_s"] = result["end_s"] - t0
    return result


def _check_overload_results(results: list[dict], rejections: float, max_waiting: int, max_queued: int,
                            p50_limit_s: float | None, p99_limit_s: float | None) -> tuple[dict, list[str]]:
    """The overload's figures and what went wrong; the latency limits (None: not checked) are the benchmark's,
    the tests check only behaviour."""
    rejected = [r for r in results if r["status"] == 503]
    served = [r for r in results if r["status"] == 200]
    latencies = [r["latency_s"] for r in rejected]
    figures = {"offered": len(results), "served": len(served), "rejected": len(rejected),
               "other_statuses": dict(Counter(r["status"] for r in results if r["status"] not in (200, 503))),
               "reject_p50_ms": 1000 * percentile(latencies, 0.5), "reject_p99_ms": 1000 * percentile(latencies, 0.99),
               "reject_max_ms": 1000 * max(latencies, default=float("nan")),
               "served_p50_s": percentile([r["latency_s"] for r in served], 0.5),
               "max_waiting": max_waiting, "admission_rejections_delta": rejections}
    failures = []
    if figures["other_statuses"]:
        failures.append(f"statuses other than 200 and 503: {figures['other_statuses']}")
    if not all(r["reasons"] == ["length"] for r in served):
        failures.append("a served request did not finish with length")
    bad = [r for r in rejected if r.get("code") != "queue_full" or not (r.get("retry_after") or "").isdigit()
           or int(r["retry_after"]) <= 0]
    if bad:
        failures.append(f"{len(bad)} 503s without code queue_full and a positive Retry-After, e.g. {bad[0]}")
    if max_waiting > max_queued:
        failures.append(f"the waiting queue reached {max_waiting} (cap {max_queued})")
    if rejections != len(rejected):
        failures.append(f"vllm:admission_rejections grew by {rejections:.0f} for {len(rejected)} 503s")
    if rejected and p50_limit_s is not None and not figures["reject_p50_ms"] < 1000 * p50_limit_s:
        failures.append(f"503 p50 {figures['reject_p50_ms']:.1f} ms (limit {1000 * p50_limit_s:.0f} ms)")
    if rejected and p99_limit_s is not None and not figures["reject_p99_ms"] < 1000 * p99_limit_s:
        failures.append(f"503 p99 {figures['reject_p99_ms']:.1f} ms (limit {1000 * p99_limit_s:.0f} ms)")
    return figures, failures


def run_overload_wave(server, max_num_seqs: int = 4, max_queued: int = 16, factor: int = 3,
                      max_tokens: int = 300, p50_limit_s: float | None = 0.05,
                      p99_limit_s: float | None = 0.05) -> tuple[dict, list[str]]:
    """Fill the server (running + queue) at once, then offer a request every 20 ms: factor x its capacity
    in all, arriving while it is full. Returns (figures, failed checks)."""
    model, _ = model_info(server)
    capacity = max_num_seqs + max_queued
    offered = factor * capacity
    body = {"model": model, "prompt": OVERLOAD_PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    rejections_before = server.metric("vllm:admission_rejections")
    state = {"done": False, "max_waiting": 0}

    async def wave() -> list:
        limits = httpx.Limits(max_connections=offered + 4, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits,
                                     headers=server.headers) as client:
            watcher = asyncio.ensure_future(_watch_waiting(client, state))
            tasks = [asyncio.ensure_future(_timed(client, body)) for _ in range(capacity)]
            await asyncio.sleep(0.5)
            for _ in range(offered - capacity):
                tasks.append(asyncio.ensure_future(_timed(client, body)))
                await asyncio.sleep(0.02)
            state["last_offer_s"] = time.monotonic()
            results = await asyncio.gather(*tasks)
            state["done"] = True
            await watcher
        return results

    results = asyncio.run(wave())
    rejections = server.metric("vllm:admission_rejections") - rejections_before
    figures, failures = _check_overload_results(results, rejections, state["max_waiting"], max_queued,
                                                p50_limit_s, p99_limit_s)
    # every request served before the last arrival freed a place that a later arrival may have taken
    freed = sum(1 for r in results if r["status"] == 200 and r["end_s"] < state["last_offer_s"])
    if figures["rejected"] < offered - capacity - freed - 2:  # 2: a place freed just before a client sees it
        failures.append(f"only {figures['rejected']} of {offered} requests rejected (capacity {capacity}, "
                        f"{freed} served while they arrived)")
    idle, kv = idle_state(server, 10.0)
    if not idle:
        failures += idle_failures(kv) or ["the server did not return to idle"]
    return {"mode": "overload-wave", "capacity": capacity, "factor": factor, **figures, "kv_after": kv}, failures


def run_overload_sustained(server, duration_s: float = 60.0, max_num_seqs: int = 4, max_queued: int = 16,
                           factor: float = 3.0, max_tokens: int = 64, p50_limit_s: float = 0.05,
                           p99_limit_s: float = 0.05, seed: int = 2) -> tuple[dict, list[str]]:
    """Measure the service rate (requests/s with max_num_seqs running and nothing queued), then offer
    Poisson arrivals at factor x that rate for duration_s. Returns (figures, failed checks)."""
    model, _ = model_info(server)
    body = {"model": model, "prompt": OVERLOAD_PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    rng = random.Random(seed)
    state = {"done": False, "max_waiting": 0}

    async def measure_rate(client: httpx.AsyncClient) -> float:
        n = 4 * max_num_seqs
        semaphore = asyncio.Semaphore(max_num_seqs)

        async def one() -> None:
            async with semaphore:
                await _timed(client, body)
        t0 = time.monotonic()
        await asyncio.gather(*(one() for _ in range(n)))
        return n / (time.monotonic() - t0)

    async def sustain() -> tuple[float, list]:
        # Kept-alive connections (as an SDK client keeps them), dropped after 2 s idle: well before the
        # server's 5 s keep-alive timeout, so the server never closes one just as it is reused.
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200, keepalive_expiry=2.0)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits,
                                     headers=server.headers) as client:
            rate = await measure_rate(client)
            watcher = asyncio.ensure_future(_watch_waiting(client, state))
            tasks = []
            deadline = time.monotonic() + duration_s
            while time.monotonic() < deadline:
                tasks.append(asyncio.ensure_future(_timed(client, body)))
                await asyncio.sleep(rng.expovariate(factor * rate))
            results = await asyncio.gather(*tasks)
            state["done"] = True
            await watcher
        return rate, results

    rejections_before = server.metric("vllm:admission_rejections")
    rate, results = asyncio.run(sustain())
    rejections = server.metric("vllm:admission_rejections") - rejections_before
    figures, failures = _check_overload_results(results, rejections, state["max_waiting"], max_queued,
                                                p50_limit_s, p99_limit_s)
    if figures["rejected"] == 0:
        failures.append("no request was rejected: the offered load did not overload the server")
    idle, kv = idle_state(server, 10.0)
    if not idle:
        failures += idle_failures(kv) or ["the server did not return to idle"]
    return {"mode": "overload-sustained", "duration_s": duration_s, "factor": factor, "max_tokens": max_tokens,
            "service_rate_per_s": rate, "offered_rate_per_s": factor * rate, **figures, "kv_after": kv}, failures


def summarize_overload(f: dict) -> str:
    head = (f"overload ({f['mode']}): {f['offered']} offered" + (
        f" at {f['offered_rate_per_s']:.1f}/s (3x the measured {f['service_rate_per_s']:.1f}/s) for "
        f"{f['duration_s']:.0f} s" if "service_rate_per_s" in f else f", capacity {f['capacity']}"))
    return (f"{head}: {f['served']} served, {f['rejected']} rejected (503 p50 {f['reject_p50_ms']:.1f} ms, "
            f"p99 {f['reject_p99_ms']:.1f} ms, max {f['reject_max_ms']:.1f} ms), "
            f"other {f['other_statuses'] or 'none'}, "
            f"max waiting {f['max_waiting']}, vllm:admission_rejections +{f['admission_rejections_delta']:.0f}")


# ------------------------------------------------------------------------------------------------ main

def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="tiny (the test suite's random Llama), a path, or none: "
                        "the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--url", default=None, help="attach to this running server instead of starting one")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--load", action="store_true")
    parser.add_argument("--storm", action="store_true")
    parser.add_argument("--overload", action="store_true")
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--warmup-frac", type=float, default=0.1)
    parser.add_argument("--max-rss-growth", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--storm-requests", type=int, default=1000)
    parser.add_argument("--storm-concurrency", type=int, default=128)
    parser.add_argument("--overload-duration", type=float, default=60.0)
    parser.add_argument("--overload-max-num-seqs", type=int, default=4)
    parser.add_argument("--overload-max-queued", type=int, default=16)
    parser.add_argument("--overload-p99-ms", type=float, default=50.0,
                        help="bound on the p99 of the 503s of the sustained overload (the issue's figure)")
    parser.add_argument("--overload-wave-p99-ms", type=float, default=250.0,
                        help="bound on the p99 of the wave's 40 503s, i.e. its slowest (the CI test's bound)")
    parser.add_argument("--result-file", default=None)
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    args = parser.parse_args(argv)
    if not (args.load or args.storm or args.overload):
        args.load = True

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pagedllm-load-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    model_path: Path | None = None
    model_args: list[str] = []
    if args.url is None:
        if args.model == "tiny":
            model_path = build_tiny_model(log_dir / "model")
        elif args.model:
            model_path = Path(args.model)
        if args.model != "tiny":  # the Server defaults fit the tiny model; a real one needs a real pool
            model_args = ["--dtype", "auto", "--kv-cache-memory", "2GiB", "--max-model-len", "2048",
                          "--served-model-name", model_path.stem if model_path else "SmolLM2-135M-Instruct"]
    print(f"server logs in {log_dir}", flush=True)

    def serve(name: str, *flags: str):
        if args.url:
            return Remote(args.url, args.api_key)
        # --enable-log-requests: the storm counts the requests that reached the engine from the log
        return Server(model_path, log_dir / f"{name}.log", *model_args, "--enable-log-requests", *flags, *extra,
                      api_key=args.api_key,
                      env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})

    results: dict = {"command": sys.argv, "model_arg": args.model, "url": args.url, "extra_server_args": extra,
                     "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg_start": os.getloadavg()}
    all_failures: list[str] = []
    runs = []
    if args.load:
        runs.append(("load", (), lambda s: run_load(s, args.duration, args.concurrency, args.warmup_frac,
                                                    args.seed, args.max_rss_growth, progress=True), summarize_load))
    if args.storm:
        runs.append(("storm", (), lambda s: run_storm(s, args.storm_requests, args.storm_concurrency),
                     summarize_storm))
    if args.overload:
        flags = ("--max-num-seqs", str(args.overload_max_num_seqs),
                 "--max-num-queued-reqs", str(args.overload_max_queued))

        def overload(s):
            wave, wave_failures = run_overload_wave(
                s, args.overload_max_num_seqs, args.overload_max_queued,
                p99_limit_s=args.overload_wave_p99_ms / 1000)
            print(summarize_overload(wave), flush=True)
            sustained, sustained_failures = run_overload_sustained(
                s, args.overload_duration, args.overload_max_num_seqs, args.overload_max_queued,
                p99_limit_s=args.overload_p99_ms / 1000)
            return ({"wave": wave, "sustained": sustained},
                    [f"wave: {f}" for f in wave_failures] + [f"sustained: {f}" for f in sustained_failures])

        runs.append(("overload", flags, overload, lambda f: summarize_overload(f["sustained"])))

    for name, flags, run, summarize in runs:
        print(f"== {name}", flush=True)
        server = serve(name, *flags)
        try:
            figures, failures = run(server)
        finally:
            server.close()
        figures["failures"] = failures
        results[name] = figures
        print(summarize(figures), flush=True)
        for failure in failures:
            print(f"  FAIL {name}: {failure}", flush=True)
        all_failures += [f"{name}: {f}" for f in failures]

    results["loadavg_end"] = os.getloadavg()
    results["passed"] = not all_failures
    if args.result_file:
        Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_file).write_text(json.dumps(results, indent=1, default=str) + "\n")
        print(f"results in {args.result_file}")
    print("PASS" if not all_failures else f"FAIL: {len(all_failures)} checks failed")
    return 0 if not all_failures else 1


if __name__ == "__main__":
    sys.exit(main())
