"""Disaggregated prefill/decode between two real `pagedllm serve` processes (kv_transfer/pd_connector.py), driven as
vllm-router and vLLM's proxy drive them: the prompt to the producer with kv_transfer_params {"do_remote_decode":
true} and max_tokens 1, then to the consumer with the kv_transfer_params the producer answered.

Server A (kv_both, kv_load_failure_policy recompute, 3 s abort timeout) and server B (kv_both, policy fail, registered
under vLLM's name NixlConnector, tensor-parallel size 2: each of its ranks pulls its KV head from A's one rank, and
the scheduler counts a request loaded once both ranks have said so). A prompt moves from A to B: the decode is
token-identical to a colocated run, the bytes moved are ceil(prompt / block_size) blocks (less B's own prefix-cache
hit), and A frees its blocks once B has read them. Faults: a consumer that dies mid-read (A frees the blocks after
its timeout), a producer that dies mid-payload (A recomputes), a request aborted while its pull is in flight (its
blocks are freed when the pull ends), and the producer A killed mid-transfer (B fails the one request and stays
healthy). Nothing leaks on either side.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from server_utils import MODEL_NAME, RemoteServer, free_port

from pagedllm.kv_transfer.pd_wire import WIRE_VERSION, recv_exact, recv_frame, send_frame

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog " * 5  # 100 tokens: 7 blocks of 16
BLOCK_SIZE = 16
SENT, RECEIVED = "pagedllm:kv_transfer_sent_bytes_total", "pagedllm:kv_transfer_received_bytes_total"
FAILED, EXPIRED = "vllm:nixl_num_failed_transfers_total", "pagedllm:kv_transfer_expired_sends_total"
ABORT_TIMEOUT_S = 3
PROXY_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                        "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""What vLLM's P/D proxy example sends the producer."""


def _transfer_config(connector: str, kv_port: int, policy: str) -> str:
    return json.dumps({"kv_connector": connector, "kv_role": "kv_both", "kv_port": kv_port,
                       "kv_load_failure_policy": policy,
                       "kv_connector_extra_config": {"abort_request_timeout": ABORT_TIMEOUT_S,
                                                     "side_channel_timeout": 20}})


def _free_port_pair() -> int:
    """A port whose next one is free too (B's two tensor-parallel ranks listen on port and port + 1)."""
    for _ in range(50):
        port = free_port()
        try:
            with socket.create_server(("127.0.0.1", port + 1)):
                return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    block_bytes = (config["num_hidden_layers"] * 2 * BLOCK_SIZE * config["num_key_value_heads"] * config["head_dim"]
                   * 4)  # K and V of every layer, float32
    a_port, b_port = free_port(), _free_port_pair()
    a = RemoteServer(tiny_llama_dir, "--kv-transfer-config", _transfer_config("PagedLLMPDConnector", a_port,
                                                                              "recompute"), wait_ready=False)
    b = RemoteServer(tiny_llama_dir, "--kv-transfer-config", _transfer_config("NixlConnector", b_port, "fail"),
                     "--enable-prompt-tokens-details", "--tensor-parallel-size", "2", wait_ready=False)
    a.kv_port, b.kv_port = a_port, b_port
    try:
        a.wait_ready()
        b.wait_ready()
        yield a, b, block_bytes
    finally:
        a.close()
        b.close()


def _complete(server: RemoteServer, max_tokens: int, timeout: float = 60.0, prompt: str = PROMPT,
              **fields) -> httpx.Response:
    return server.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                                "temperature": 0.0, "return_token_ids": True, **fields},
                       timeout=timeout)


def _prefill(server: RemoteServer, prompt: str = PROMPT, **fields) -> dict:
    response = _complete(server, 1, prompt=prompt, kv_transfer_params=PROXY_PREFILL_PARAMS, **fields)
    assert response.status_code == 200, response.text
    params = response.json()["kv_transfer_params"]
    assert params is not None, response.text
    return params


def _tokens(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def _wait(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _all_free(server: RemoteServer) -> bool:
    kv = server.kv_cache()
    return kv["num_free_blocks"] == kv["num_total_blocks"]


def test_decode_matches_colocated_and_moves_the_prompt_blocks(pair):
    a, b, block_bytes = pair
    colocated = _tokens(_complete(b, 12))
    sent, received = a.metric(SENT), b.metric(RECEIVED)
    params = _prefill(a)
    num_prompt = 100
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert len(params["remote_block_ids"]) == math.ceil(num_prompt / BLOCK_SIZE)
    assert params["remote_port"] == a.kv_port and params["tp_size"] == 1
    assert {"remote_engine_id", "remote_request_id", "remote_host"} <= params.keys()
    assert not _all_free(a)  # kept for the consumer
    b.post("/reset_prefix_cache")  # B computed this prompt colocated: with its blocks cached it would pull fewer
    response = _complete(b, 12, kv_transfer_params=params)
    assert _tokens(response) == colocated
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == num_prompt - 1  # loaded
    moved = math.ceil(num_prompt / BLOCK_SIZE) * block_bytes
    assert b.metric(RECEIVED) - received == moved
    _wait(lambda: a.metric(SENT) - sent == moved and _all_free(a))  # A frees the blocks once B has read them
    assert _all_free(b)

    # Again: B now has the prompt's full blocks in its prefix cache and pulls only the last, partial one.
    received = b.metric(RECEIVED)
    response = _complete(b, 12, kv_transfer_params=_prefill(a))
    assert _tokens(response) == colocated
    assert b.metric(RECEIVED) - received == block_bytes

    # A tenant's salt: B's unsalted blocks of this prompt are not its, so every block is pulled.
    received = b.metric(RECEIVED)
    response = _complete(b, 12, kv_transfer_params=_prefill(a, cache_salt="tenant"), cache_salt="tenant")
    assert _tokens(response) == colocated
    assert b.metric(RECEIVED) - received == moved
    _wait(lambda: _all_free(a) and _all_free(b))


def test_chat_completions_carry_kv_transfer_params(pair):
    a, b, _ = pair
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me about foxes " * 8}],
            "temperature": 0.0}
    colocated = a.post("/v1/chat/completions", json={**body, "max_tokens": 10}).json()
    assert colocated["kv_transfer_params"] is None  # not asked for: nothing kept
    prefill = a.post("/v1/chat/completions", json={**body, "max_tokens": 1,
                                                   "kv_transfer_params": {"do_remote_decode": True}}).json()
    received = b.metric(RECEIVED)
    decode = b.post("/v1/chat/completions", json={**body, "max_tokens": 10,
                                                  "kv_transfer_params": prefill["kv_transfer_params"]}).json()
    assert decode["choices"][0]["message"] == colocated["choices"][0]["message"]
    assert b.metric(RECEIVED) > received
    _wait(lambda: _all_free(a) and _all_free(b))


def test_consumer_dying_mid_read_leaves_the_blocks_until_the_timeout(pair):
    """A read of blocks that are not the request's is refused. A consumer reads part of the payload and dies (closes
    without its done): A counts a failed transfer, keeps the blocks (another read could still come) and frees them
    after abort_request_timeout."""
    a, _, _ = pair
    failed, expired = a.metric(FAILED), a.metric(EXPIRED)
    params = _prefill(a)
    read = {"op": "read", "version": WIRE_VERSION, "engine_id": params["remote_engine_id"],
            "request_id": params["remote_request_id"], "heads": None, "consumer_tp_size": 1}
    other_block = max(params["remote_block_ids"]) + 1
    with socket.create_connection((params["remote_host"], params["remote_port"]), timeout=10) as conn:
        send_frame(conn, {**read, "block_ids": [other_block]})  # another request's (or a free) block: refused
        assert recv_frame(conn)["ok"] is False
    with socket.create_connection((params["remote_host"], params["remote_port"]), timeout=10) as conn:
        send_frame(conn, {**read, "block_ids": params["remote_block_ids"]})
        header = recv_frame(conn)
        assert header["ok"] and header["nbytes"] > 0
        recv_exact(conn, memoryview(bytearray(header["nbytes"] // 3)))
    _wait(lambda: a.metric(FAILED) == failed + 1)
    assert not _all_free(a)
    _wait(lambda: _all_free(a) and a.metric(EXPIRED) == expired + 1, timeout_s=ABORT_TIMEOUT_S + 10)


def _dying_producer(num_blocks_bytes: int) -> tuple[dict, threading.Thread]:
    """A producer's side channel that sends the header and a third of the payload, then dies."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                message = recv_frame(conn)
                n = len(message["block_ids"])
                send_frame(conn, {"ok": True, "nbytes": num_blocks_bytes * n, "dtype": "float32",
                                  "shape": [3, 2, n, BLOCK_SIZE, 2, 16]})
                conn.sendall(bytes(num_blocks_bytes * n // 3))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": list(range(32)),
              "remote_engine_id": "dying", "remote_request_id": "dying-1", "remote_host": "127.0.0.1",
              "remote_port": listener.getsockname()[1], "tp_size": 1}
    return params, thread


def test_producer_dying_mid_payload_is_recomputed(pair):
    a, _, block_bytes = pair
    prompt = "Pack my box with five dozen liquor jugs " * 6
    colocated = _tokens(_complete(a, 8, prompt=prompt))
    a.post("/reset_prefix_cache")
    params, thread = _dying_producer(block_bytes)
    failed = a.metric(FAILED)
    assert _tokens(_complete(a, 8, prompt=prompt, kv_transfer_params=params)) == colocated  # recomputed
    thread.join(10)
    assert not thread.is_alive()  # it was read from
    assert a.metric(FAILED) == failed + 1
    _wait(lambda: _all_free(a))
    assert a.get("/health").status_code == 200


def test_abort_while_the_pull_is_in_flight_frees_after_the_pull(pair):
    a, b, _ = pair
    params = _prefill(a)
    engine = a.kv_cache()["engine_pid"]
    os.kill(engine, signal.SIGSTOP)  # A's side channel stalls: B's pull waits for its answer
    try:
        def client_gives_up() -> None:  # B aborts the request when its client goes
            with pytest.raises(httpx.ReadTimeout):
                _complete(b, 8, timeout=4.0, kv_transfer_params=params)

        client = threading.Thread(target=client_gives_up)
        client.start()
        _wait(lambda: not _all_free(b))  # admitted: its blocks are allocated and the pull started
        client.join(30)
        _wait(lambda: b.kv_cache()["num_open_requests"] == 0)
        assert not _all_free(b)  # aborted, but the pull may still write into its blocks
    finally:
        os.kill(engine, signal.SIGCONT)
    _wait(lambda: _all_free(b) and _all_free(a))  # the pull ended: B frees them, and A once read (or expired)


def test_producer_killed_mid_transfer_fails_the_request_under_policy_fail(pair):
    """Last: it kills A. B (kv_load_failure_policy fail) fails the one request, frees its blocks, and serves on."""
    a, b, _ = pair
    colocated = _tokens(_complete(b, 6))
    params = _prefill(a)
    engine = a.kv_cache()["engine_pid"]
    os.kill(engine, signal.SIGSTOP)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", _complete(b, 6, kv_transfer_params=params)))
    thread.start()
    _wait(lambda: b.kv_cache()["num_waiting_reqs"] == 1)  # waiting for its remote KV
    time.sleep(0.3)
    os.kill(engine, signal.SIGKILL)  # mid-transfer: B has sent its read, A never answers
    a.proc.kill()
    thread.join(30)
    response = result["r"]
    assert response.status_code >= 400 and "kv_load_failure_policy" in response.text, response.text
    _wait(lambda: _all_free(b))
    assert b.get("/health").status_code == 200
    assert _tokens(_complete(b, 6)) == colocated
