"""API keys and tenants: a blank key is a start-up error (never authentication silently off), a repeated
Authorization header counts once (the first, as vLLM), and a client's request_id is private to its request (two
tenants using the same id both run and neither learns of the other)."""

from __future__ import annotations

import asyncio
import socket
import subprocess

import pytest
from reliability_utils import MODEL_NAME, free_port

from server_process import serve_command, serve_env

pytestmark = pytest.mark.slow

KEYS = ("sk-alpha-93b1f0", "sk-beta-2c7e44")


@pytest.fixture(scope="module")
def keyed_server(launcher):
    return launcher("--api-key", ",".join(KEYS), "--cache-salt-from-api-key", api_key=KEYS[0], name="keyed")


def test_blank_api_key_is_a_startup_error(serve_model):
    """Each refuses to start within seconds, with a message naming the flag, and never serves (before: the
    first three served every route without a key, and with --cache-salt-from-api-key every completion 500ed)."""
    cases = {
        "blank list": (["--api-key", " , "], {}, "--api-key contains a blank key"),
        "one blank of three": (["--api-key", "k1,,k2"], {}, "--api-key contains a blank key"),
        "blank env": ([], {"VLLM_API_KEY": " "}, "VLLM_API_KEY contains a blank key"),
        "blank with salt": (["--api-key", " ", "--cache-salt-from-api-key"], {}, "--api-key contains a blank key"),
        "salt without key": (["--cache-salt-from-api-key"], {"VLLM_API_KEY": None},
                             "--cache-salt-from-api-key needs --api-key"),
    }
    procs = {}
    for name, (flags, env, _) in cases.items():
        environment = {k: v for k, v in serve_env().items() if k != "VLLM_API_KEY"}
        environment.update({k: v for k, v in env.items() if v is not None})
        procs[name] = subprocess.Popen(serve_command(serve_model, free_port(), *flags), env=environment,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for name, proc in procs.items():
            try:
                output = proc.communicate(timeout=60)[0].decode(errors="replace")
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name}: the server started instead of refusing the configuration")
            assert proc.returncode == 2, (name, proc.returncode, output[-2000:])
            assert cases[name][2] in output, (name, output[-2000:])
            assert "Serving" not in output and "Traceback" not in output, (name, output[-2000:])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _raw_status(port: int, headers: list[tuple[str, str]]) -> int:
    head = "\r\n".join(["GET /v1/models HTTP/1.1", "Host: x", *(f"{k}: {v}" for k, v in headers),
                        "Connection: close", "", ""]).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


def test_repeated_authorization_header_uses_the_first(keyed_server):
    good, bad = f"Bearer {KEYS[1]}", "Bearer wrong"
    assert _raw_status(keyed_server.port, [("Authorization", bad), ("Authorization", good)]) == 401  # before: 200
    assert _raw_status(keyed_server.port, [("Authorization", good), ("Authorization", bad)]) == 200  # before: 401
    assert _raw_status(keyed_server.port, [("Authorization", good), ("authorization", good)]) == 200


def test_same_request_id_from_two_tenants_runs_both(keyed_server):
    """Tenant one holds a request_id in flight (a stream it reads slowly); tenant two sends the same id, streaming
    and not: all three succeed with the id echoed, and each gets its own text (before: 400 "request_id
    'cmpl-shared' is already in use" for tenant two, which told it tenant one's id was in flight)."""
    request = dict(model=MODEL_NAME, prompt="the same id from two tenants", max_tokens=24, temperature=0.0)
    body = {"request_id": "shared", "ignore_eos": True}

    async def scenario():
        async with keyed_server.async_client(api_key=KEYS[0]) as one, \
                keyed_server.async_client(api_key=KEYS[1]) as two:
            held = await one.completions.create(**request, stream=True, extra_body=body)
            chunks = [await held.__anext__()]  # tenant one's request is in the engine now
            plain = await two.completions.create(**request, extra_body=body)
            streamed = [c async for c in await two.completions.create(**request, stream=True, extra_body=body)]
            chunks += [c async for c in held]
            return chunks, plain, streamed

    chunks, plain, streamed = asyncio.run(scenario())
    assert {c.id for c in chunks} == {c.id for c in streamed} == {plain.id} == {"cmpl-shared"}
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text and text == plain.choices[0].text == "".join(c.choices[0].text for c in streamed if c.choices)
    assert plain.usage.completion_tokens == 24
    assert keyed_server.kv()["num_open_requests"] == 0
