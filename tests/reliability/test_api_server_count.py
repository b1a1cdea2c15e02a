"""--api-server-count 2 on real servers of the tiny model: two API-server processes accept on one port in front of
one engine core (and, with --data-parallel-size 2, of two), with the same greedy tokens as one API server, requests
spread over both (seen by the pid that answers and in each one's log), /metrics coherent whichever one answers,
an abort from either freeing its blocks, SIGTERM of the parent stopping every process with nothing left, and
kill -9 of an engine core taking every API server down."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from reliability_utils import MODEL_NAME, REAL_STEP_ENV, descendants, pid_alive, stream_until_error, wait_for

pytestmark = pytest.mark.slow

FLAGS = ("--max-num-seqs", "64", "--block-size", "8", "--api-server-count", "2")
PROMPTS = [f"Request number {i} says" for i in range(8)]
LONG = {"model": MODEL_NAME, "max_tokens": 400, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def servers(launcher):
    """Both servers start at once (start-up is most of the cost): two API servers over one engine core, and two
    over two data-parallel engine cores (the kill test ends the second)."""
    one = launcher(*FLAGS, name="api2", env=REAL_STEP_ENV, wait_ready=False)
    dp = launcher(*FLAGS, "--data-parallel-size", "2", "--engine-death-exit-delay", "5", name="api2dp2",
                  wait_ready=False)
    return one.wait_ready(), dp.wait_ready()


def _complete(url: str, prompt: str) -> tuple[str, int]:
    """The greedy text, and the pid of the API server that answered (each call on a new connection)."""
    with httpx.Client(base_url=url, timeout=60.0) as http:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0.0}
        text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    return text, _answering_pid(url)


def _answering_pid(url: str) -> int:
    return httpx.get(url + "/debug/kv_cache", headers={"Connection": "close"}, timeout=30.0).json()["api_server_pid"]


def _api_server_pids(server) -> list[int]:
    """The parent's children that run the API servers (the engine cores are the others)."""
    pids = []
    for pid in descendants(server.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"api_server_proc" in f.read():
                    pids.append(pid)
        except OSError:
            pass
    return pids


@pytest.mark.parametrize("which", [0, 1], ids=["one-engine", "dp2"])
def test_greedy_tokens_equal_one_api_server_and_requests_spread(servers, shared_server, which):
    server = servers[which]
    expected = [shared_server.client().completions.create(model=MODEL_NAME, prompt=p, max_tokens=12,
                                                          temperature=0.0).choices[0].text for p in PROMPTS]
    api_pids = set(_api_server_pids(server))
    assert len(api_pids) == 2, api_pids
    seen: set[int] = set()
    for _ in range(5):  # which process accepts a connection is the kernel's choice: a few rounds until both did
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(lambda p: _complete(server.url, p), PROMPTS))
        assert [text for text, _ in results] == expected
        seen |= {pid for _, pid in results}
        if seen == api_pids:
            break
    assert seen == api_pids, (seen, api_pids)
    log = server.log()
    assert "[api_server 0]" in log and "[api_server 1]" in log  # each one logs with its index
    # counted once, whichever API server renders /metrics: every request of every round, the prompt tokens once
    answers = [server.metric("vllm:request_success_total") for _ in range(6)]
    assert len(set(answers)) == 1 and answers[0] % len(PROMPTS) == 0, answers
    queries = server.metric("vllm:prefix_cache_queries_total")
    assert queries == server.metric("vllm:prompt_tokens_total") > 0


def test_engine_gauges_and_aborts_from_either_api_server(servers):
    server = servers[0]
    results: list = []
    lock = threading.Lock()
    started = threading.Barrier(2)
    holder = threading.Thread(target=stream_until_error, args=(
        server.client(), {**LONG, "prompt": "A long stream"}, started, results, lock))
    holder.start()
    started.wait(timeout=60)
    seen = set()
    for _ in range(8):  # new connections: either API server answers, and each knows the engine's gauge
        response = httpx.get(server.url + "/metrics", headers={"Connection": "close"}, timeout=30.0)
        running = [line for line in response.text.splitlines() if line.startswith("vllm:num_requests_running")]
        assert running == [f'vllm:num_requests_running{{model_name="{MODEL_NAME}"}} 1.0'], running
        seen.add(_answering_pid(server.url))
    # a client that goes away mid-stream, on a fresh connection to each API server in turn: its blocks come back
    for _ in range(4):
        body = {"model": MODEL_NAME, "prompt": "Abandoned", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60.0) as response:
            next(response.iter_lines())
    holder.join(timeout=120)
    assert results and results[0][0] == "completed", results
    assert wait_for(lambda: server.kv()["num_running_reqs"] == 0, 30.0), server.kv()
    assert wait_for(lambda: (kv := server.kv())["num_free_blocks"] == kv["num_total_blocks"], 30.0), server.kv()
    assert server.metric('vllm:request_success_total{finished_reason="abort"') == 4


def test_sigterm_of_the_parent_stops_every_process(servers):
    server = servers[0]
    children = descendants(server.proc.pid)
    assert len(children) >= 3, children  # one engine core, two API servers
    socket_dirs = {line.split("ipc://")[1].rsplit("/", 1)[0] for pid in children
                   for line in open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\0") if "ipc://" in line}
    server.http.close()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0, server.log()[-3000:]
    assert wait_for(lambda: not [pid for pid in children if pid_alive(pid)], 30.0)
    assert socket_dirs and not any(os.path.exists(d) for d in socket_dirs), socket_dirs
    assert "Traceback" not in server.log()


def test_a_killed_engine_core_takes_every_api_server_down(servers):
    server = servers[1]
    engines = [engine["engine_pid"] for engine in server.kv()["engines"]]
    children = descendants(server.proc.pid)
    os.kill(engines[1], signal.SIGKILL)
    for _ in range(4):  # every API server says so (new connections reach either)
        assert wait_for(lambda: httpx.get(server.url + "/health", headers={"Connection": "close"},
                                          timeout=10.0).status_code == 503, 30.0)
    assert server.proc.wait(timeout=120) != 0
    assert wait_for(lambda: not [pid for pid in children if pid_alive(pid)], 30.0), \
        [pid for pid in children if pid_alive(pid)]
    log = server.log()
    assert "[api_server 0]" in log and "[api_server 1]" in log
    assert log.count("engine core process exited unexpectedly") >= 2, log[-3000:]
