"""Data parallelism (--data-parallel-size 2) on real servers of the tiny model: the same greedy tokens as one
engine, requests routed by cached prefix then by load (seen in the per-replica metrics), and kill -9 of one
replica: the whole server fails fast (every stream ends, /health 503, the server exits non-zero, nothing left)."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from reliability_utils import (
    MODEL_NAME,
    REAL_STEP_ENV,
    descendants,
    pid_alive,
    stream_until_error,
    unavailable,
    wait_for,
)

pytestmark = pytest.mark.slow

DP2 = ("--data-parallel-size", "2", "--max-num-seqs", "64", "--block-size", "8",  # shared_server's, at DP=2
       "--engine-death-exit-delay", "15")  # time to look at /health and /metrics after the kill test's kill
PROMPTS = ["The quick brown fox", "Once upon a time", "1, 2, 3, 4,", "Paris is the capital of", "Hello, my name is",
           "The sky is"]
SHARED = "A long system prompt that many requests share, word after word, to fill several blocks. " * 3
LONG = {"model": MODEL_NAME, "max_tokens": 400, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(launcher):
    """One DP=2 server for the module (a server start is most of its cost): the kill test comes last in the file
    and ends it."""
    return launcher(*DP2, name="dp", env=REAL_STEP_ENV)  # the kill must find both streams running


def _by_engine(server, name: str) -> list[float]:
    """A metric's value per replica (`engine` label 0, 1), summed over its other labels."""
    return [server.metric(f'{name}{{engine="{rank}"') for rank in (0, 1)]


def _complete(server, prompt: str) -> str:
    response = server.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0.0)
    return response.choices[0].text


def test_greedy_tokens_equal_one_engine(server, shared_server):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: both replicas serve some
        dp = list(pool.map(lambda p: _complete(server, p), PROMPTS))
    assert dp == [_complete(shared_server, p) for p in PROMPTS]
    assert all(n > 0 for n in _by_engine(server, "vllm:prompt_tokens_total")), server.metrics()
    log = server.log()
    assert "data parallel size 2: engine 0 pid" in log and "[engine 1]" in log


def test_shared_prefix_stays_on_its_replica_and_distinct_prompts_spread_by_load(server):
    client = server.client()
    queries_start = _by_engine(server, "vllm:prefix_cache_queries_total")
    client.completions.create(model=MODEL_NAME, prompt=SHARED + "First question?", max_tokens=1)
    hits_before = _by_engine(server, "vllm:prefix_cache_hits_total")
    queries_before = _by_engine(server, "vllm:prefix_cache_queries_total")
    first = [r for r in (0, 1) if queries_before[r] > queries_start[r]]  # where the shared prefix was computed
    results: list = []
    holder = threading.Thread(target=stream_until_error, args=(
        client, {**LONG, "prompt": "An unrelated long story"}, None, results, threading.Lock()))
    holder.start()  # a long stream: both replicas idle, so it goes to rank 0
    assert wait_for(lambda: server.kv()["engines"][0]["num_running_reqs"] == 1, 30.0), server.kv()
    client.completions.create(model=MODEL_NAME, prompt=SHARED + "Second question?", max_tokens=1)
    client.completions.create(model=MODEL_NAME, prompt="Something else entirely", max_tokens=1)
    running = [e["num_running_reqs"] for e in server.kv()["engines"]]
    hits = [after - before for after, before in zip(_by_engine(server, "vllm:prefix_cache_hits_total"),
                                                    hits_before, strict=True)]
    queries = [after - before for after, before in zip(_by_engine(server, "vllm:prefix_cache_queries_total"),
                                                       queries_before, strict=True)]
    holder.join(timeout=60)
    assert first == [0] and running == [1, 0], (first, running)  # the stream still held replica 0
    # The second shared-prefix request went to replica 0, busier, and hit its cache; the unrelated one, to 1.
    assert hits[0] >= 64 and hits[1] == 0, (hits, queries)
    assert queries[1] > 0, queries
    assert results and results[0][0] == "completed", results


def test_a_killed_replica_fails_the_whole_server_fast(server):
    """Issue 32 item 7 (before: the other replica kept serving, /health answered 503 for ever and the dead replica's
    gauges stayed at their last values): kill -9 of one replica ends the streams on both, /health and new requests
    answer 503, the dead replica's gauges leave /metrics, and after --engine-death-exit-delay the server exits
    non-zero with no process of it left (the live replica stopped, not orphaned)."""
    pids = [engine["engine_pid"] for engine in server.kv()["engines"]]
    children = descendants(server.proc.pid)
    assert set(pids) <= set(children), (pids, children)
    client = server.client(timeout=60.0)
    results: list = []
    lock = threading.Lock()
    started = threading.Barrier(3)
    threads = [threading.Thread(target=stream_until_error, args=(client, {**LONG, "prompt": prompt}, started,
                                                                  results, lock))
               for prompt in ("Alpha stream of the kill test", "Bravo stream of the kill test")]  # by load
    # one per replica: prompts no earlier test sent, different from the first token (a block of one cached or
    # routed to a replica would draw the other there)
    for t in threads:
        t.start()
    started.wait(timeout=60)
    assert [e["num_running_reqs"] for e in server.kv()["engines"]] == [1, 1]
    assert server.metric('vllm:num_requests_running{engine="1"') == 1.0
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    assert wait_for(lambda: unavailable(server), 60.0)
    # what the server says while it waits out --engine-death-exit-delay, before anything slower (the streams)
    assert server.proc.poll() is None, "exited before --engine-death-exit-delay"
    health = server.http.get("/health")
    assert health.status_code == 503 and "engine 1: engine core process exited unexpectedly" in health.text
    response = server.http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2})
    assert response.status_code == 503, response.text
    metrics = server.metrics()
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                  "pagedllm:kv_cache_free_blocks", "pagedllm:kv_cache_total_blocks"):
        assert not [k for k in metrics if k.startswith(f'{gauge}{{engine="1"')], gauge  # no frozen value
        assert [k for k in metrics if k.startswith(f'{gauge}{{engine="0"')], gauge
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 2 and all(outcome != "completed" for outcome, _ in results), results
    assert all("engine" in str(outcome).lower() for outcome, _ in results), results
    print(f"FIGURE DP=2 replica kill: both streams errored after {max(at for _, at in results) - killed_at:.2f} s")
    assert server.proc.wait(timeout=120) != 0  # a hang guard: it exits after --engine-death-exit-delay
    assert wait_for(lambda: not [pid for pid in children if pid_alive(pid)], 30.0), \
        [pid for pid in children if pid_alive(pid)]
    assert "the server is (data parallelism fails fast)" in server.log()
