"""Fixtures for the reliability suite (tests/reliability): the tiny model of tests/conftest.py served by
real `pagedllm serve` processes.

Server start-up dominates the suite's time, so: the servers serve the GGUF copy of the tiny model (its
tokenizer loads without importing torch: ~4 s less CPU per API server), one session-wide server serves
every test that leaves it as it found it (`shared_server`), and a module that needs servers with their own
flags launches them all at once (`launcher(..., wait_ready=False)`, then `server.wait_ready()` in the
test), so their start-ups overlap instead of adding up."""

from __future__ import annotations

from pathlib import Path

import pytest
from reliability_utils import Server


@pytest.fixture(scope="session")
def serve_model(tiny_llama_gguf) -> Path:
    return tiny_llama_gguf


class Launcher:
    """launch(*flags, env=..., api_key=..., wait_ready=...) -> Server; close() stops every server launched."""

    def __init__(self, model: Path, folder: Path):
        self.model = model
        self.folder = folder
        self.servers: list[Server] = []

    def __call__(self, *args: str, name: str = "server", **kwargs) -> Server:
        server = Server(self.model, self.folder / f"{name}-{len(self.servers)}.log", *args, **kwargs)
        self.servers.append(server)
        return server

    def close(self) -> None:
        for server in self.servers:
            server.close()


@pytest.fixture(scope="session")
def shared_server(serve_model, tmp_path_factory):
    """One plain server for the whole session: bad inputs, the unconstrained KV reference, the disconnect
    storm. Every test that uses it leaves it idle, with every KV block free. It trusts request chat templates,
    so that the bad-input tests reach the template sandbox."""
    server = Server(serve_model, tmp_path_factory.mktemp("shared") / "server.log", "--max-num-seqs", "64",
                    "--block-size", "8", "--trust-request-chat-template", "--enable-log-requests")
    yield server
    server.close()


@pytest.fixture(scope="module")
def launcher(serve_model, tmp_path_factory):
    launch = Launcher(serve_model, tmp_path_factory.mktemp("servers"))
    yield launch
    launch.close()


@pytest.fixture
def server_factory(serve_model, tmp_path):
    """start(*flags, env=..., api_key=...) -> Server; every server started is stopped after the test."""
    launch = Launcher(serve_model, tmp_path)
    yield launch
    launch.close()
