"""A disaggregated prefill/decode pair driven unchanged by the routers users run: a producer (`kv_role`
kv_producer) and a consumer (kv_consumer) `pagedllm serve`, both with `--kv-transfer-config
{"kv_connector": "NixlConnector", ...}`, behind vllm-router in P/D mode (PyPI `vllm-router`, the test extra) and
behind the small proxy of benchmarks/disagg_proxy.py (vLLM's toy proxy protocol), driven with the real `openai`
client.

What vllm-router 0.1.17 sends (`--vllm-pd-disaggregation`, its default `--kv-connector nixl`): to the prefill
server the client's body with max_tokens 1, min_tokens 1, stream false and kv_transfer_params
{"do_remote_decode": true, "do_remote_prefill": false, "remote_*": null} (plus fields of its own, such as
no_stop_trim and return_hidden_states, which pagedllm ignores with a warning as vLLM does); to the decode server
the client's body with the prefill answer's kv_transfer_params, verbatim; both with one X-Request-Id.

Each answer through a router equals the colocated greedy answer (the same prompt sent to a server directly), the
consumer pulled the prompt's KV from the producer (its received-bytes counter grows), and afterwards neither side
holds a block."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from server_process import MODEL_NAME, free_port, router_client, serve_command, serve_env, wait_healthy

_BESIDE = Path(sys.executable).with_name("vllm-router")
ROUTER = str(_BESIDE) if _BESIDE.exists() else shutil.which("vllm-router")
PROXY = Path(__file__).resolve().parents[2] / "benchmarks" / "disagg_proxy.py"
RECEIVED = "pagedllm:kv_transfer_received_bytes_total"
FAILED = "vllm:nixl_num_failed_transfers_total"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (the test extra)")]


class Server:
    def __init__(self, model: Path, role: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_port": free_port()}
        self.proc = subprocess.Popen(serve_command(model, self.port, "--kv-transfer-config", json.dumps(config)),
                                     env=serve_env())

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def held_blocks(self, timeout_s: float = 20.0) -> int:
        """Blocks still in use once nothing runs (0 when every block went back to the pool)."""
        deadline = time.monotonic() + timeout_s
        while True:
            kv = httpx.get(self.url + "/debug/kv_cache", timeout=10).json()
            held = kv["num_total_blocks"] - kv["num_free_blocks"]
            if held == 0 or time.monotonic() > deadline:
                return held
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    """(producer, consumer), started side by side."""
    servers = [Server(tiny_llama_dir, "kv_producer"), Server(tiny_llama_dir, "kv_consumer")]
    try:
        for server in servers:
            wait_healthy(server.proc, server.url)
        yield servers
    finally:
        for server in servers:
            server.close()


def vllm_router(producer: Server, consumer: Server):
    port = free_port()
    return router_client([ROUTER, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
                  "--prefill", producer.url, "--decode", consumer.url, "--policy", "round_robin",
                  "--prometheus-port", str(free_port()), "--log-level", "warning"], port)


def proxy(producer: Server, consumer: Server):
    port = free_port()
    return router_client([sys.executable, str(PROXY), "--port", str(port), "--prefill", producer.url,
                  "--decode", consumer.url], port)


def _complete(client: openai.OpenAI, prompt: str, stream: bool = False) -> str:
    kwargs = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    if not stream:
        return client.completions.create(**kwargs).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices)


def _chat(client: openai.OpenAI, content: str) -> str:
    return client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": content}],
                                          max_tokens=8, temperature=0.0).choices[0].message.content


def _check(pair: list[Server], make_front, tag: str) -> None:
    producer, consumer = pair
    prompts = [f"{tag}: the quick brown fox jumps over the lazy dog, paged attention stores the KV cache. " * 2,
               f"{tag}: hello world! How are you today? I am fine, thank you. Numbers like 12345 appear. " * 2]
    with make_front(producer, consumer) as client:
        for stream, prompt in zip((False, True), prompts, strict=True):
            before = consumer.metric(RECEIVED)
            answer = _complete(client, prompt, stream=stream)
            assert consumer.metric(RECEIVED) > before, "the consumer did not pull the prompt's KV"
            assert answer == _complete(producer.client(), prompt)  # the colocated greedy answer
        before = consumer.metric(RECEIVED)
        chat = _chat(client, prompts[0][:60])
        assert consumer.metric(RECEIVED) > before
        assert chat == _chat(producer.client(), prompts[0][:60])
    assert [server.held_blocks() for server in pair] == [0, 0]


def test_vllm_router_drives_the_pair(pair):
    _check(pair, vllm_router, "router")


def test_disagg_proxy_drives_the_pair(pair):
    _check(pair, proxy, "proxy")


def test_vllm_router_n_and_batches(pair):
    """n > 1 moves the prompt's KV once (child 0's; the other children start from it in the consumer's cache):
    no failed pull, no block left held on the producer. A batch of prompts with kv_transfer_params is refused
    with a 400 naming the field (one kv_transfer_params names one prompt's blocks), passed on by the router."""
    producer, consumer = pair
    prompt = "n two: paged attention stores the KV cache in fixed-size blocks, the fox jumps. " * 2
    with vllm_router(producer, consumer) as client:
        failed, received = consumer.metric(FAILED), consumer.metric(RECEIVED)
        answer = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0.0, n=2)
        assert consumer.metric(RECEIVED) > received
        assert consumer.metric(FAILED) == failed
        assert [c.text for c in answer.choices] == [_complete(producer.client(), prompt)] * 2
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL_NAME, prompt=[prompt, "a second prompt"], max_tokens=4)
        assert "kv_transfer_params" in str(refused.value)
    assert [server.held_blocks() for server in pair] == [0, 0]
