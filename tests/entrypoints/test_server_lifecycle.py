"""Process lifetime of `pagedllm serve`: startup failure, engine death, SIGTERM drain, queue full, stuck
engine, and no orphans either way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

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


def test_startup_fails_fast_with_the_engine_message(tiny_llama_dir):
    # 2 blocks of 16 tokens cannot hold one request of max_model_len 512
    args = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", str(tiny_llama_dir),
            "--port", "1", "--num-gpu-blocks-override", "2", "--dtype", "float32"]
    start = time.monotonic()
    result = subprocess.run(args, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 1
    assert "failed to start" in result.stderr and "max_model_len=512" in result.stderr
    assert time.monotonic() - start < 60


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
        t.join(timeout=10)
    assert len(errors) == 3, errors
    assert all(isinstance(e, openai.APIError) for e, _ in errors)
    assert all("engine" in str(e).lower() for e, _ in errors)
    assert max(at for _, at in errors) - killed_at < 2.0
    health = server.get("/health")
    assert health.status_code == 503 and health.json()["error"]["code"]
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    assert info.value.status_code == 503
    # then the API server exits too (after --engine-death-exit-delay)
    assert server.proc.wait(timeout=20) == 1


def test_sigterm_drains_running_requests(remote_server_factory):
    server = remote_server_factory("--drain-timeout", "30")
    engine_pid = server.kv_cache()["engine_pid"]
    client = server.client(timeout=30.0)
    stream = iter(client.completions.create(**LONG, stream=True))
    first = next(stream)
    server.proc.send_signal(signal.SIGTERM)
    refused = _wait_for(lambda: server.post("/v1/completions", json={"prompt": "x"}).status_code == 503, 5.0)
    assert refused
    response = server.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert response.status_code == 503 and response.headers.get("retry-after")
    assert response.json()["error"]["code"] == "shutting_down"
    assert server.get("/health").status_code == 503
    chunks = [first, *stream]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in chunks if c.choices) >= 2
    assert server.proc.wait(timeout=20) == 0
    assert _wait_for(lambda: not pid_alive(engine_pid), 10.0)


def test_queue_full_is_503_and_stuck_engine_is_unhealthy(remote_server_factory):
    server = remote_server_factory("--max-num-seqs", "1", "--max-num-queued-reqs", "1",
                                   "--health-check-timeout", "1")
    client = server.client(timeout=30.0)
    running = iter(client.completions.create(**LONG, stream=True))
    next(running)
    waiting = client.completions.create(**LONG, stream=True)  # headers arrive: it is in the engine
    assert _wait_for(lambda: server.kv_cache()["num_waiting_reqs"] == 1, 5.0)
    with pytest.raises(openai.InternalServerError) as info:  # the SDK's class for 5xx
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    assert info.value.status_code == 503 and info.value.body["code"] == "queue_full"
    assert server.metric("vllm:admission_rejections_total") == 1
    waiting.close()
    running.close()
    kv = server.wait_idle()
    assert kv["num_free_blocks"] == kv["num_total_blocks"]
    assert client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2).choices[0].text is not None

    engine_pid = kv["engine_pid"]
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        health = server.get("/health", timeout=10.0)
        assert health.status_code == 503 and time.monotonic() - start < 3.0
    finally:
        os.kill(engine_pid, signal.SIGCONT)
    assert _wait_for(lambda: server.get("/health").status_code == 200, 5.0)


def test_engine_exits_when_api_server_is_killed(tiny_llama_dir):
    server = RemoteServer(tiny_llama_dir, debug_routes=False)
    try:
        assert server.get("/debug/kv_cache").status_code == 404  # off by default
        children = server.child_pids()
        assert len(children) == 1
        engine_pid = children[0]
        server.proc.kill()
        server.proc.wait()
        assert _wait_for(lambda: not pid_alive(engine_pid), 10.0), "engine core outlived the API server"
    finally:
        server.close()
