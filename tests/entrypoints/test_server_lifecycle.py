"""Process lifetime of `pagedllm serve`: engine death, queue full, stuck engine, and no orphans either way.
(Start-up failures and the SIGTERM drain are tested, with more cases, in tests/reliability/test_lifecycle.py.)"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
from server_utils import MODEL_NAME, RemoteServer, pid_alive

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog"
LONG = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 450, "extra_body": {"ignore_eos": True}}


def _wait_for(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def test_engine_kill_fails_open_streams_and_health(remote_server_factory):
    server = remote_server_factory("--max-num-seqs", "8", "--engine-death-exit-delay", "3")
    engine_pid = server.kv_cache()["engine_pid"]
    client = server.client(timeout=30.0)
    errors: list[tuple[BaseException, float]] = []
    started = threading.Barrier(4)

    def consume():
        stream = client.completions.create(**LONG, stream=True)
        try:
            iterator = iter(stream)
            next(iterator)
            started.wait()
            for _ in iterator:
                pass
        except Exception as e:  # openai.APIError for the error event
            errors.append((e, time.monotonic()))

    threads = [threading.Thread(target=consume) for _ in range(3)]
    for t in threads:
        t.start()
    started.wait(timeout=30)
    killed_at = time.monotonic()
    os.kill(engine_pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=60)
    assert len(errors) == 3, errors
    assert all(isinstance(e, openai.APIError) for e, _ in errors)
    assert all("engine" in str(e).lower() for e, _ in errors)  # the engine's death, not the client's timeout
    print(f"FIGURE engine kill: 3/3 streams errored, last after {max(at for _, at in errors) - killed_at:.2f} s")
    health = server.get("/health")
    assert health.status_code == 503 and health.json()["error"]["code"]
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    assert info.value.status_code == 503
    # then the API server exits too (after --engine-death-exit-delay)
    assert server.proc.wait(timeout=60) == 1


def test_queue_full_is_503_and_stuck_engine_is_unhealthy(remote_server_factory):
    server = remote_server_factory("--max-num-seqs", "1", "--max-num-queued-reqs", "1",
                                   "--health-check-timeout", "1")
    client = server.client(timeout=30.0)
    running = iter(client.completions.create(**LONG, stream=True))
    next(running)
    waiting = client.completions.create(**LONG, stream=True)  # headers arrive: it is in the engine
    assert _wait_for(lambda: server.kv_cache()["num_waiting_reqs"] == 1, 30.0)
    with pytest.raises(openai.InternalServerError) as info:  # the SDK's class for 5xx
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    assert info.value.status_code == 503 and info.value.body["code"] == "queue_full"
    assert server.metric("vllm:admission_rejections_total") == 1
    waiting.close()
    running.close()
    kv = server.wait_idle()
    assert kv["num_free_blocks"] == kv["num_total_blocks"]
    after = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 2 and after.choices[0].finish_reason == "length"

    engine_pid = kv["engine_pid"]
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        health = server.get("/health", timeout=30.0)
        assert health.status_code == 503
        # it says what failed (before: "unhealthy: TimeoutError")
        assert "did not answer a health check within 1 s" in health.json()["error"]["message"], health.text
        assert httpx.head(server.url + "/health", timeout=10.0).status_code == 503
    finally:
        os.kill(engine_pid, signal.SIGCONT)
    assert _wait_for(lambda: server.get("/health").status_code == 200, 30.0)


def test_queue_cap_counts_sequences_and_refuses_what_never_fits(remote_server_factory):
    """--max-num-queued-reqs counts as vllm:num_requests_waiting does: one per choice per prompt. Issue 17: on an
    idle server with a cap of 8, n >= 10 or 16 prompts always got 503 + Retry-After ("8 requests are waiting",
    none were: the engine refused the request's own 9th child), so clients retried forever. Now a request
    that needs more places than the cap gets a 400 that says why, one that fits is served whole, and a 503
    states how many are really waiting."""
    server = remote_server_factory("--max-num-seqs", "1", "--max-num-queued-reqs", "8")
    client = server.client(timeout=30.0)
    for extra in ({"n": 10}, {"n": 16}, {"prompt": [PROMPT] * 16}, {"prompt": [PROMPT] * 3, "n": 3}):
        response = server.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2,
                                                        **extra})
        assert response.status_code == 400, (extra, response.status_code, response.text)
        message = response.json()["error"]["message"]
        assert "--max-num-queued-reqs=8" in message and "never" in message, message
    for extra in ({"n": 8}, {"prompt": [PROMPT] * 8}, {"prompt": [PROMPT] * 2, "n": 4}):
        response = client.completions.create(model=MODEL_NAME, prompt=extra.pop("prompt", PROMPT), max_tokens=2,
                                             **extra)
        assert len(response.choices) == 8, extra

    running = iter(client.completions.create(**LONG, stream=True))
    next(running)  # runs alone (--max-num-seqs 1)
    waiting = client.completions.create(**LONG, n=6, stream=True)  # 6 sequences wait
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, n=3)
    assert info.value.status_code == 503 and info.value.body["code"] == "queue_full"
    assert info.value.response.headers["Retry-After"] == "1"
    assert "6 requests are waiting" in info.value.body["message"], info.value.body
    fits = client.completions.create(**LONG, n=2, stream=True)  # 6 + 2 = 8: admitted
    for stream in (fits, waiting, running):
        stream.close()
    kv = server.wait_idle()
    assert kv["num_free_blocks"] == kv["num_total_blocks"]


def test_engine_exits_when_api_server_is_killed(tiny_llama_dir):
    server = RemoteServer(tiny_llama_dir, debug_routes=False)
    try:
        assert server.get("/debug/kv_cache").status_code == 404  # off by default
        children = server.child_pids()
        assert len(children) == 1
        engine_pid = children[0]
        server.proc.kill()
        server.proc.wait()
        assert _wait_for(lambda: not pid_alive(engine_pid), 30.0), "engine core outlived the API server"
    finally:
        server.close()
