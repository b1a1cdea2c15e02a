"""The external-router mode: two `pagedllm serve` processes behind vllm-router (PyPI `vllm-router`, the Rust
router of the vLLM project), driven through the router with the real `openai` client; each backend's /metrics
says which one served what.

- round_robin alternates the backends.
- cache_aware (the router's approximate prefix tree over the request texts it routed; no KV events) keeps the
  requests that share a long prefix on one backend, where the second hits the first's blocks.
- kv_aware reads the backends' KV events (--kv-events-config, one tcp endpoint each; the router tokenizes with
  the model folder's tokenizer): a prefix cached on a backend by a request sent to it directly draws the next
  request with that prefix to that backend, whichever it is."""

from __future__ import annotations

import shutil
import signal
import sys
import time
from pathlib import Path

import openai
import pytest
from server_utils import MODEL_NAME, RemoteServer, free_port

from server_process import router_client

_BESIDE = Path(sys.executable).with_name("vllm-router")
ROUTER = str(_BESIDE) if _BESIDE.exists() else shutil.which("vllm-router")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (the test extra)")]
SHARED = "You are a helpful assistant. Answer in one word. Paris is in France, Rome is in Italy. " * 2


@pytest.fixture(scope="module")
def backends(tiny_llama_dir):
    """Two servers started side by side, each publishing KV events on its own tcp port: (servers, ports)."""
    ports = [free_port() for _ in range(2)]
    servers = [RemoteServer(tiny_llama_dir, "--kv-events-config",
                            f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{port}"}}', wait_ready=False)
               for port in ports]
    try:
        for server in servers:
            server.wait_ready()
        yield servers, ports
    finally:
        for server in servers:  # both stop at once
            if server.proc.poll() is None:
                server.proc.send_signal(signal.SIGINT)
        for server in servers:
            server.close()


def router(policy: str, servers: list[RemoteServer], *extra: str):
    """vllm-router on a free port in front of `servers`; yields an openai client pointed at it."""
    port = free_port()
    return router_client([ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                          "--worker-urls", *(s.url for s in servers), "--prometheus-port", str(free_port()),
                          "--log-level", "warning", *extra], port)


def _served(servers: list[RemoteServer]) -> list[float]:
    return [s.metric("vllm:e2e_request_latency_seconds_count") for s in servers]


def _complete(client: openai.OpenAI, prompt: str) -> str:
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0.0).choices[0].text


def test_round_robin_alternates_the_backends(backends):
    servers, _ = backends
    prompts = ["The quick brown fox", "Once upon a time", "Paris is", "One two three"]
    before = _served(servers)
    with router("round_robin", servers) as client:
        answers = [_complete(client, p) for p in prompts]
    assert [a - b for a, b in zip(_served(servers), before, strict=True)] == [2, 2]
    assert answers == [_complete(servers[0].client(), p) for p in prompts]  # greedy: the same on either backend


def _route(servers: list[RemoteServer], client: openai.OpenAI, prompt: str) -> tuple[int, str]:
    """Send one request; returns the index of the backend that served it, and the answer."""
    before = _served(servers)
    answer = _complete(client, prompt)
    (index,) = [i for i, (a, b) in enumerate(zip(_served(servers), before, strict=True)) if a > b]
    return index, answer


def test_cache_aware_keeps_a_shared_prefix_on_one_backend(backends):
    servers, _ = backends
    prompts = [SHARED + "Where is Paris?", "Numbers, counted slowly: " * 6 + "one?",
               SHARED + "Where is Rome?", "Numbers, counted slowly: " * 6 + "two?"]  # two pairs, interleaved
    hits_before = [s.metric("vllm:prefix_cache_hits_total") for s in servers]
    with router("cache_aware", servers) as client:
        routes, answers = zip(*(_route(servers, client, p) for p in prompts), strict=True)
    assert routes[0] == routes[2] and routes[1] == routes[3], routes
    hits = [s.metric("vllm:prefix_cache_hits_total") - h for s, h in zip(servers, hits_before, strict=True)]
    assert hits[routes[2]] >= 64  # the second of a pair reused the first's blocks
    assert list(answers) == [_complete(servers[0].client(), p) for p in prompts]


def test_kv_aware_follows_the_backends_kv_events(backends, tiny_llama_dir):
    servers, ports = backends
    sources = []
    for server, port in zip(servers, ports, strict=True):
        sources += ["--kv-event-source", f"{server.url}=tcp://127.0.0.1:{port}"]
    with router("kv_aware", servers, *sources, "--kv-event-model", str(tiny_llama_dir)) as client:
        for target in (1, 0):  # each backend in turn holds the prefix
            prefix = f"Backend {target} alone has seen this preamble. " * 4
            _complete(servers[target].client(), prefix + "First question?")  # directly, not through the router
            time.sleep(0.5)  # the BlockStored events reach the router
            backend, answer = _route(servers, client, prefix + "Second question?")
            assert backend == target
            assert answer == _complete(servers[1 - target].client(), prefix + "Second question?")
