"""Fixtures for the reliability suite (tests/reliability): the tiny model of tests/conftest.py served by
real `pagedllm serve` processes, one per module where the tests can share it."""

from __future__ import annotations

import pytest
from reliability_utils import Server


@pytest.fixture
def server_factory(tiny_llama_dir, tmp_path):
    """start(*flags, env=..., api_key=...) -> Server; every server started is stopped after the test."""
    servers: list[Server] = []

    def start(*args: str, **kwargs) -> Server:
        server = Server(tiny_llama_dir, tmp_path / f"server-{len(servers)}.log", *args, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()
