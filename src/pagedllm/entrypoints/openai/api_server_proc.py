"""One API-server process of several (--api-server-count N), started by the `pagedllm serve` parent
(api_server_manager.py).

Run as `python -m pagedllm.entrypoints.openai.api_server_proc` with an `APIServerSpec` as one JSON line on stdin
and the listening socket inherited at `listen_fd`. It attaches to every engine core (one per data-parallel rank)
as client `client_index`, then serves the shared socket with the same app as a lone API server (run.py).

Lifetime: SIGTERM drains and SIGINT aborts, as a lone server; the parent forwards them. stdin stays open: EOF
means the parent is gone, and the process stops as on SIGTERM. An engine core's death ends it as it ends a lone
server (503 for --engine-death-exit-delay, then exit 1).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading

import msgspec

from pagedllm.config import EngineConfig, ServerConfig
from pagedllm.engine.core_client import EngineCoreClient, EngineStartupError

logger = logging.getLogger(__name__)


class EngineAddress(msgspec.Struct):
    """One engine core as an API server reaches it."""

    pid: int
    input_addr: str
    output_addr: str


class APIServerSpec(msgspec.Struct):
    engine_config: EngineConfig
    server_config: ServerConfig
    client_index: int
    listen_fd: int
    engines: list[EngineAddress]
    """One per data-parallel rank, in rank order."""
    salt_secret: bytes
    """--cache-salt-from-api-key's key, made by the parent: one for all the API servers."""


async def attach_engine_cores(engines: list[EngineAddress], client_index: int,
                              startup_timeout_s: float) -> list[EngineCoreClient]:
    """Attach to every engine core at once; EngineStartupError (naming the rank) if one does not become ready."""
    ranked = len(engines) > 1
    results = await asyncio.gather(*(
        EngineCoreClient.attach(e.pid, e.input_addr, e.output_addr, client_index, startup_timeout_s,
                                rank if ranked else None) for rank, e in enumerate(engines)), return_exceptions=True)
    clients = [r for r in results if isinstance(r, EngineCoreClient)]
    failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    if failed:
        for client in clients:
            client.shutdown()
        rank, error = failed[0]
        if isinstance(error, EngineStartupError) and ranked:
            raise EngineStartupError(f"engine core {rank}: {error}") from error
        raise error
    return clients


def _stop_when_parent_dies() -> None:
    """stdin is a pipe from the parent: EOF means it is gone; stop as on SIGTERM (drain)."""
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except OSError:
        pass
    logger.warning("the parent process is gone; stopping")
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    from pagedllm.entrypoints.openai.run import SharedEngines, run

    spec = msgspec.json.decode(sys.stdin.buffer.readline(), type=APIServerSpec)
    logging.basicConfig(level=logging.INFO, datefmt="%m-%d %H:%M:%S",
                        format=f"%(levelname)s %(asctime)s [api_server {spec.client_index}] [%(name)s] %(message)s")
    threading.Thread(target=_stop_when_parent_dies, name="parent-watch", daemon=True).start()
    sock = socket.socket(fileno=spec.listen_fd)
    shared = SharedEngines(spec.client_index, sock, lambda timeout_s: attach_engine_cores(
        spec.engines, spec.client_index, timeout_s), spec.salt_secret)
    return run(spec.engine_config, spec.server_config, shared)


if __name__ == "__main__":
    from pagedllm.child_process import exit_after_cleanup

    exit_after_cleanup(main())
