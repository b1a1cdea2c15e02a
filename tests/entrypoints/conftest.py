"""Fixtures for the server tests: a real `pagedllm serve` process with the tiny model of tests/conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_utils import TINY_API_KEY, RemoteServer

_HERE = Path(__file__).parent
_SHARED: dict[tuple, RemoteServer] = {}


def shared_remote_server(model: Path | None, *args: str) -> RemoteServer:
    """One server per (model, flags) while the run is in tests/entrypoints: a module whose tests only send
    requests (no flag of its own, nothing left changed: no sleep, LoRA loading, kill) takes it instead of
    starting its own, so modules with the same flags share one start-up. Stopped when the run leaves the folder."""
    key = (str(model), args)
    server = _SHARED.get(key)
    if server is None or server.proc.poll() is not None:
        server = _SHARED[key] = RemoteServer(model, *args)
    return server


def _close_shared() -> None:
    while _SHARED:
        _SHARED.popitem()[1].close()


def pytest_runtest_teardown(item, nextitem):
    if _SHARED and (nextitem is None or _HERE not in Path(nextitem.path).parents):
        _close_shared()


def pytest_sessionfinish(session):
    _close_shared()


@pytest.fixture(scope="module")
def smollm2_server() -> RemoteServer:
    """The embedded SmolLM2 with the shipped Hermes tool template (the template is for it), auto tool choice
    read by the llama3_json parser, a 1,024-token context, 32 sequences at once and a 320 MiB KV pool: shared
    (shared_remote_server) by the tool-calling tests (the parser flag, the shipped template) and the
    structured-output and tool-call validity tests (whose response_format, `required` and named tool choices
    constrain the output whatever the template, and never use the parser)."""
    return shared_remote_server(None, "--chat-template", "tool_chat_template_hermes.jinja", "--max-model-len",
                                "1024", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
                                "--max-num-seqs", "32", "--kv-cache-memory", "320MiB")


@pytest.fixture(scope="module")
def tiny_api_server(tiny_llama_dir) -> RemoteServer:
    """The tiny model behind --api-key TINY_API_KEY (`headers` carries it), 8 sequences at once, prompt token
    details in usage, structured outputs by the guidance backend named explicitly: shared (shared_remote_server)
    by the OpenAI API tests and the structured-output tests."""
    server = shared_remote_server(tiny_llama_dir, "--api-key", TINY_API_KEY, "--max-num-seqs", "8",
                                  "--enable-prompt-tokens-details", "--structured-outputs-config",
                                  '{"backend": "guidance"}')
    server.headers = {"Authorization": f"Bearer {TINY_API_KEY}"}
    return server


@pytest.fixture
def remote_server_factory(tiny_llama_dir):
    """start(*flags) -> RemoteServer; every server started is stopped at the end of the test."""
    servers: list[RemoteServer] = []

    def start(*args: str, **kwargs) -> RemoteServer:
        server = RemoteServer(tiny_llama_dir, *args, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()
