"""Data parallelism (--data-parallel-size 2) on real servers of the tiny model: the same greedy tokens as one
engine, requests routed by cached prefix then by load (seen in the per-replica metrics), and kill -9 of one
replica: its streams end, /health answers 503, the other replica keeps serving."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from reliability_utils import MODEL_NAME, stream_until_error, unavailable, wait_for

pytestmark = pytest.mark.slow

DP2 = ("--data-parallel-size", "2", "--max-num-seqs", "64", "--block-size", "8")  # shared_server's, at DP=2
PROMPTS = ["The quick brown fox", "Once upon a time", "1, 2, 3, 4,", "Paris is the capital of", "Hello, my name is",
           "The sky is"]
SHARED = "A long system prompt that many requests share, word after word, to fill several blocks. " * 3
LONG = {"model": MODEL_NAME, "max_tokens": 400, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(launcher):
    """One DP=2 server for the module (a server start is most of its cost): the kill test comes last in the file
    and leaves replica 1 dead."""
    return launcher(*DP2, name="dp")


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


def test_a_killed_replica_ends_its_streams_and_the_other_keeps_serving(server):
    pids = [engine["engine_pid"] for engine in server.kv()["engines"]]
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
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    unhealthy = wait_for(lambda: unavailable(server), 2.0)
    health_s = time.monotonic() - killed_at
    assert wait_for(lambda: len(results) >= 1, 2.0), results
    error_s = results[0][1] - killed_at
    for t in threads:
        t.join(timeout=60)
    outcomes = [outcome for outcome, _ in results]
    assert outcomes[0] != "completed" and "engine" in str(outcomes[0]).lower(), outcomes
    assert outcomes[1] == "completed", outcomes  # the surviving replica's stream ran to its end
    print(f"FIGURE DP=2 replica kill: its stream errored after {error_s:.2f} s; /health 503 after {health_s:.2f} s")
    assert unhealthy and error_s < 2.0
    response = server.http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2})
    assert response.status_code == 200, response.text  # served by the live replica
    assert server.http.get("/health").status_code == 503 and server.proc.poll() is None
    assert "engine 1: engine core process exited unexpectedly" in server.http.get("/health").text
