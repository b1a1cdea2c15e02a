"""Process lifetime: start-up failures (a max_model_len the KV pool cannot hold, a missing model path, a
corrupt GGUF) and SIGTERM with requests in flight (a 30 s drain that lets them finish, and drain 0 that ends
them with finish reason `abort`). Nothing is orphaned either way.

(Moved here from tests/entrypoints/test_server_lifecycle.py and extended: the start-up failure and drain
tests there covered one case and one request.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from reliability_utils import MODEL_NAME, REAL_STEP_ENV, pid_alive, wait_for

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def servers(launcher) -> dict:
    """Both drain servers, launched at once (their start-ups overlap the start-up failure test's), with steps of a
    real model's length: the 10 requests must all be running when SIGTERM comes."""
    return {"drain30": launcher("--drain-timeout", "30", env=REAL_STEP_ENV, wait_ready=False),
            "drain0": launcher("--drain-timeout", "0", env=REAL_STEP_ENV, wait_ready=False)}


def _tagged_pids(tag: str) -> list[int]:
    """Live processes whose environment carries PAGEDLLM_TEST_TAG=tag: a server started with it and every process
    it started (the engine core and its workers run in sessions of their own, and an orphan has no parent)."""
    needle = f"PAGEDLLM_TEST_TAG={tag}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and pid_alive(int(entry)):
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def test_startup_failures_exit_fast_with_the_figures(servers, serve_model, tmp_path):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(serve_model.read_bytes()[:4096])  # the header and part of the metadata
    missing = tmp_path / "no-such-model"
    cases = {
        # 2 blocks of 16 tokens cannot hold one request of max_model_len 512
        "kv-too-small": ([str(serve_model), "--num-gpu-blocks-override", "2"],
                         ["failed to start", "2 blocks", "32 tokens", "max_model_len=512", "needs 32 blocks",
                          "--kv-cache-memory"]),
        "missing-path": ([str(missing)], ["failed to start", str(missing), "not found"]),
        "corrupt-gguf": ([str(corrupt)], ["failed to start", str(corrupt), "corrupt or truncated GGUF"]),
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    procs = {}
    start = time.monotonic()
    for name, (args, _) in cases.items():  # all at once: their start-ups overlap
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", *args, "--port", "1",
             "--dtype", "float32", "--disable-log-stats"],
            env={**env, "PAGEDLLM_TEST_TAG": f"{os.getpid()}-{name}"}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    for name, proc in procs.items():
        output, _ = proc.communicate(timeout=120)
        elapsed = time.monotonic() - start
        print(f"FIGURE start-up failure {name}: exit {proc.returncode} after {elapsed:.1f} s")
        assert proc.returncode not in (0, None), (name, output[-2000:])
        for needle in cases[name][1]:
            assert needle in output, (name, needle, output[-2000:])
        assert "Traceback" not in output.split("failed to start", 1)[-1], output[-2000:]
        tag = f"{os.getpid()}-{name}"
        assert wait_for(lambda tag=tag: not _tagged_pids(tag), 30.0), ("orphans", name, _tagged_pids(tag))


def _in_flight(server, num: int, max_tokens: int) -> tuple[list[threading.Thread], list]:
    """`num` requests (half streaming, half not) open in the server; returns their threads and a result
    list of (kind, finish_reasons, number of chunks or error) filled as they end."""
    results: list = []
    lock = threading.Lock()
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}

    def streaming():
        reasons, chunks, done = [], 0, False
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                              timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunk = httpx.Response(200, content=line[6:]).json()
                        assert "error" not in chunk, chunk
                        chunks += 1
                        reasons += [c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]]
                    done |= line == "data: [DONE]"
            outcome = ("stream", reasons, chunks if done else "no [DONE]")
        except Exception as e:
            outcome = ("stream", reasons, repr(e))
        with lock:
            results.append(outcome)

    def full():
        try:
            response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            outcome = ("full", [c["finish_reason"] for c in response.json()["choices"]], response.status_code)
        except Exception as e:
            outcome = ("full", [], repr(e))
        with lock:
            results.append(outcome)

    threads = [threading.Thread(target=streaming if i % 2 else full) for i in range(num)]
    for t in threads:
        t.start()
    assert wait_for(lambda: server.kv()["num_running_reqs"] == num, 30.0), server.kv()
    return threads, results


def test_sigterm_drain_30s_lets_10_requests_finish(servers):
    server = servers["drain30"].wait_ready()
    engine_pid = server.engine_pid()
    threads, results = _in_flight(server, 10, 200)
    server.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    refused = []
    short = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
    assert wait_for(lambda: refused.append(server.http.post("/v1/completions", json=short)) or
                    refused[-1].status_code == 503, 30.0)
    response = server.http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
    assert response.status_code == 503 and int(response.headers["retry-after"]) > 0
    assert response.json()["error"]["code"] == "shutting_down"
    for t in threads:
        t.join(timeout=120)
    finished_s = time.monotonic() - sent
    exit_code = server.proc.wait(timeout=120)
    exit_s = time.monotonic() - sent
    print(f"FIGURE SIGTERM drain 30: {len(results)}/10 requests completed {finished_s:.1f} s after SIGTERM, "
          f"exit {exit_code} after {exit_s:.1f} s")
    assert len(results) == 10 and all(r[1] == ["length"] for r in results), results
    assert all(r[2] == 200 for r in results if r[0] == "full"), results
    assert all(isinstance(r[2], int) and r[2] >= 2 for r in results if r[0] == "stream"), results
    assert exit_code == 0
    assert wait_for(lambda: not pid_alive(engine_pid), 30.0)


def test_sigterm_drain_0_aborts_in_flight_requests(servers):
    server = servers["drain0"].wait_ready()
    engine_pid = server.engine_pid()
    threads, results = _in_flight(server, 10, 450)
    server.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    exit_code = server.proc.wait(timeout=120)
    exit_s = time.monotonic() - sent
    for t in threads:
        t.join(timeout=60)
    print(f"FIGURE SIGTERM drain 0: exit {exit_code} after {exit_s:.2f} s; finish reasons "
          f"{sorted(str(r[1]) for r in results)}")
    assert len(results) == 10
    assert all(r[1] == ["abort"] for r in results), results
    assert all(r[2] == 200 for r in results if r[0] == "full"), results
    assert all(isinstance(r[2], int) for r in results if r[0] == "stream"), results  # ended with [DONE]
    assert exit_code == 0  # without waiting for the 450 tokens: every request ended as an abort (above)
    assert wait_for(lambda: not pid_alive(engine_pid), 30.0)
