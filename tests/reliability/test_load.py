"""Load: KV-cache exhaustion (preemption without loss), 30 s of mixed load at concurrency 128 (no 5xx, no
memory, fd or KV-block leak), a disconnect storm (nothing leaks), and 3x overload against
--max-num-queued-reqs 16 (fast 503s, counted). CI-sized versions of the issue's checks; the load, storm and
overload drivers are those of benchmarks/load_test.py, which runs the full-size versions."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest
from reliability_utils import MODEL_NAME, REAL_STEP_ENV, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import load_test  # noqa: E402

pytestmark = pytest.mark.slow

KV_BLOCKS, BLOCK_SIZE = 64, 8
KV_PROMPT_LEN, KV_MAX_TOKENS = 150, 55  # 205 tokens = 26 blocks = 40% of the pool
STALL_HANG_TIMEOUT_S = 4


@pytest.fixture(scope="module")
def servers(launcher) -> dict:
    """The module's own servers, launched at once; the unconstrained reference is the shared server (same
    model and block size, a pool of thousands of blocks)."""
    return {
        "kv": launcher("--num-gpu-blocks-override", str(KV_BLOCKS), "--block-size", str(BLOCK_SIZE),
                       "--max-model-len", "256", "--max-num-seqs", "64", wait_ready=False),
        "overload": launcher("--max-num-seqs", "4", "--max-num-queued-reqs", "16", wait_ready=False),
        # steps of a real model's length (the tiny model's ~1 ms steps with n=16 and 20 logprobs outrun an API
        # server on busy cores by seconds, so a close would be seen only after the engine had finished anyway)
        "stalled": launcher("--max-num-seqs", "4", env=REAL_STEP_ENV, wait_ready=False),
        "load": launcher(wait_ready=False),
        "stall": launcher("--health-check-timeout", "2", "--engine-hang-timeout", str(STALL_HANG_TIMEOUT_S),
                          "--max-buffered-outputs", "256", wait_ready=False),
    }


async def _stream_completion(client: httpx.AsyncClient, body: dict, events: list[float]) -> tuple[str, list]:
    """Stream one completion; returns its text and finish reasons; appends each chunk's arrival time."""
    text, reasons = "", []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in load_test.sse_lines(response):
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                events.append(time.monotonic())
                for choice in chunk["choices"]:
                    text += choice["text"]
                    if choice["finish_reason"]:
                        reasons.append(choice["finish_reason"])
    return text, reasons


def _idle_and_free(server) -> dict:
    assert wait_for(lambda: (lambda kv: kv["num_running_reqs"] + kv["num_waiting_reqs"] + kv["num_open_requests"]
                             == 0 and kv["num_free_blocks"] == kv["num_total_blocks"] and kv["total_ref_cnt"] == 0)(
        server.kv()), 30.0), server.kv()
    return server.kv()


def test_kv_exhaustion_preempts_without_changing_outputs(servers, shared_server):
    server = servers["kv"].wait_ready()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 380) for _ in range(KV_PROMPT_LEN)] for _ in range(50)]
    body = {"model": MODEL_NAME, "max_tokens": KV_MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}

    async def run(url: str) -> tuple[list, list[float], float]:
        events: list[float] = []
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            start = time.monotonic()
            results = await asyncio.gather(*(_stream_completion(client, {**body, "prompt": p}, events)
                                             for p in prompts))
        return results, sorted([start, *events]), time.monotonic() - start

    preemptions_before = server.metric("vllm:num_preemptions")
    reference, _, reference_s = asyncio.run(run(shared_server.url))
    results, events, elapsed = asyncio.run(run(server.url))
    preemptions = server.metric("vllm:num_preemptions") - preemptions_before
    longest_gap = max(b - a for a, b in zip(events, events[1:], strict=False))
    print(f"FIGURE KV exhaustion: 50 requests of {KV_PROMPT_LEN}+{KV_MAX_TOKENS} tokens on {KV_BLOCKS} blocks of "
          f"{BLOCK_SIZE}: {elapsed:.1f} s (unconstrained {reference_s:.1f} s), {preemptions:.0f} preemptions, "
          f"longest stall {longest_gap:.2f} s")
    assert all(reasons == ["length"] for _, reasons in results), results
    assert [text for text, _ in results] == [text for text, _ in reference]
    assert preemptions > 0
    _idle_and_free(server)


LOAD_S, LOAD_WARMUP_S = 30.0, 16.0


def test_mixed_load_leaks_nothing(servers):
    """The issue's 10-minute load test, for 30 s (60 s, then 40 s, until the suite neared CI's 15 minutes): 128
    clients sending mixed requests (both endpoints, streaming or not, prompt lengths and max_tokens mixed). Zero
    5xx, API-server RSS growth < 5% after the warm-up, fds back to baseline, and after the drain nothing running
    or waiting, every block free and every ref_cnt 0. Every kind of request is sent (checked below), so the
    shorter run cuts only the window the RSS growth is measured over.

    The warm-up is the first 16 s whatever the length (the benchmark's is 10% of 10 minutes): the API server's
    RSS climbs for its first ~20 s of load (98 -> 110 MiB, arenas and caches filling) and then creeps; measured
    from 6 s the growth to 60 s was 4.3%, too close to the limit for a shared CI machine."""
    server = servers["load"].wait_ready()
    figures, failures = load_test.run_load(server, duration_s=LOAD_S, concurrency=128,
                                           warmup_frac=LOAD_WARMUP_S / LOAD_S)
    print(f"FIGURE {load_test.summarize_load(figures)}")
    assert not failures, (failures, figures["problem_examples"])
    assert len(figures["requests_by_kind"]) == 4, figures["requests_by_kind"]  # both endpoints, streamed or not


def test_disconnect_storm_leaks_nothing(shared_server):
    """300 requests at concurrency 64 (the benchmark: 1,000 at 128), 20% of the clients closing at a random
    point, half of them streaming: nothing running or waiting, every block free, every ref_cnt 0, one abort
    counted per close."""
    figures, failures = load_test.run_storm(shared_server, num_requests=300, concurrency=64)
    print(f"FIGURE {load_test.summarize_storm(figures)}")
    assert not failures, (failures, figures["problems"])


def test_stalled_stream_closed_by_its_client_is_aborted(servers):
    """A streaming client that stops reading (the socket buffers fill and the server's write blocks), then
    closes: every one of its n requests that had not finished by then ends as an abort, none runs on to
    max_tokens. (Before the fix, Starlette cancelled the blocked write and left the SSE generator unclosed:
    10-30% of such closes were never aborted.) The server runs 4 requests at a time, so most of the 16 are
    still running or waiting when the client closes. Its steps last 4 ms more than the tiny model's: with ~1 ms
    steps the engine ran seconds ahead of an API server on busy cores (measured: 3.9 s from the request to its
    first running report, 7 s from the close to idle), and finished the 16 before the close reached it."""
    server = servers["stalled"].wait_ready()
    body = json.dumps({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 480, "ignore_eos": True,
                       "stream": True, "n": 16, "logprobs": 20}).encode()
    pending_at_close = []
    for _ in range(6):
        before = load_test.finished_by_reason(server)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            sock.connect(("127.0.0.1", server.port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            # read nothing: once the engine runs the group, half a second fills the socket buffers (the server's
            # writes block) and leaves most requests unfinished even on a fast machine (a fixed 1.5 s let a Zen 5
            # finish 12 of the 16 before the close)
            assert wait_for(lambda: server.kv()["num_running_reqs"] > 0, 10.0)
            time.sleep(0.5)
            finished = load_test.finished_by_reason(server).get("length", 0) - before.get("length", 0)
        assert wait_for(lambda: server.kv()["num_running_reqs"] + server.kv()["num_waiting_reqs"] == 0, 30.0)
        after = load_test.finished_by_reason(server)
        lengths = after.get("length", 0) - before.get("length", 0)
        aborts = after.get("abort", 0) - before.get("abort", 0)
        assert lengths + aborts == 16, (lengths, aborts)
        # at most one running group (4 requests started together, so they finish in the same step) finishing
        # between the sample above and the server seeing the close; an unaborted close runs all 16 to the end
        assert lengths <= finished + 4, (finished, lengths, aborts)
        pending_at_close.append(16 - finished)
    assert sum(pending_at_close) >= 6 * 8, pending_at_close  # the closes did interrupt work
    assert server.kv()["total_ref_cnt"] == 0


def _send_and_never_read(port: int, body: dict) -> socket.socket:
    """A raw HTTP client that sends one request and never reads: with a tiny receive buffer the server's
    socket buffers fill and its writes block."""
    data = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def test_clients_that_never_read_cost_only_their_own_requests(servers):
    """Two streaming clients stop reading and never close (issue 17: after the engine finished such a
    request, /health answered 503, and the hang watchdog declared the idle engine hung and killed the server).
    One (n=16, logprobs=20, 480 tokens) outgrows --max-buffered-outputs and is aborted, its blocks freed; the
    other (n=1, 200 tokens) finishes in the engine with its outputs waiting. Past the hang timeout, /health
    stays 200, the server lives and serves another request, and nothing runs or holds a block."""
    server = servers["stall"].wait_ready()
    before = load_test.finished_by_reason(server)
    common = {"model": MODEL_NAME, "prompt": "hello", "ignore_eos": True, "stream": True, "logprobs": 20}
    big = _send_and_never_read(server.port, {**common, "n": 16, "max_tokens": 480})
    small = _send_and_never_read(server.port, {**common, "max_tokens": 200})
    try:
        assert wait_for(lambda: (lambda kv: kv["num_running_reqs"] + kv["num_waiting_reqs"] == 0
                                 and load_test.finished_by_reason(server).get("length", 0) > before.get("length", 0))(
            server.kv()), 60.0, 0.2), server.kv()
        statuses = []
        deadline = time.monotonic() + STALL_HANG_TIMEOUT_S + 2
        while time.monotonic() < deadline:
            statuses.append(server.http.get("/health").status_code)
            time.sleep(0.25)
        assert set(statuses) == {200}, statuses
        after = load_test.finished_by_reason(server)
        assert after.get("abort", 0) - before.get("abort", 0) == 16, (before, after)  # the big one, aborted
        assert after.get("length", 0) - before.get("length", 0) == 1, (before, after)  # the small one, finished
        response = server.http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4})
        assert response.status_code == 200, response.text
        assert server.proc.poll() is None
        assert "hung" not in server.log()
        kv = server.kv()
        assert kv["num_running_reqs"] + kv["num_waiting_reqs"] == 0 and kv["total_ref_cnt"] == 0, kv
        assert kv["num_free_blocks"] == kv["num_total_blocks"], kv
    finally:
        big.close()
        small.close()


def test_3x_overload_gets_counted_503s(servers):
    """3x the capacity at once: the overflow gets 503 queue_full with Retry-After, each counted once in
    vllm:admission_rejections, the waiting queue never passes its cap, every served request finishes. How fast
    the 503s come is benchmarks/load_test.py --overload's to measure (p99 < 50 ms on a quiet machine)."""
    server = servers["overload"].wait_ready()
    figures, failures = load_test.run_overload_wave(server, max_num_seqs=4, max_queued=16, factor=3,
                                                    p50_limit_s=None, p99_limit_s=None)
    print(f"FIGURE {load_test.summarize_overload(figures)}")
    assert not failures, failures
