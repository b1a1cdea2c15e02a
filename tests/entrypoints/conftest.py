"""Fixtures for the server tests: a real `pagedllm serve` process with the tiny model of tests/conftest.py."""

from __future__ import annotations

import pytest
from server_utils import RemoteServer


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
