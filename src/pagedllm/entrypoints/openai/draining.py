"""DrainingServer: uvicorn's server, with a first SIGTERM that drains and a Ctrl-C that ends open requests cleanly.

    SIGTERM      drain: refuse new requests, let open ones finish (--drain-timeout), then abort the rest and exit
    SIGINT       (Ctrl-C), or a second SIGTERM: abort every open request now and exit
    any further  uvicorn's: a Ctrl-C while stopping forces the exit

An aborted request ends as the drain timeout ends it: finish_reason "abort", its last chunk and [DONE] (a 200
with the text so far when not streaming), never cut off. Before, Ctrl-C under open streams left them to uvicorn's
5 s graceful-shutdown timeout, which cancelled them with a traceback per request ("Exception in ASGI
application ... CancelledError") and errors for the aborts that could no longer reach the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from pagedllm.entrypoints.openai.server_state import ServerState

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM drains and Ctrl-C aborts open requests before the server closes."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float):
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self._drain_task: asyncio.Task | None = None
        self._stopping = False
        """A Ctrl-C (or a second SIGTERM) is ending the open requests: the next signal is uvicorn's."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, except that the signal is not raised again once the server has stopped: the process
        exits through its own cleanup (shutting the engine down) with the exit code `run` returns."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._stopping or self.should_exit:
            super().handle_exit(sig, frame)
            return
        loop = asyncio.get_event_loop()
        if sig == signal.SIGTERM and not self.state.draining:
            self.state.draining = True
            loop.call_soon_threadsafe(self._start, self._drain())
            return
        self._stopping = True
        self.state.draining = True
        loop.call_soon_threadsafe(self._start, self._stop_now(signal.Signals(sig).name))

    def _start(self, coro) -> None:
        if self._drain_task is not None:
            self._drain_task.cancel()
        self._drain_task = asyncio.ensure_future(coro)

    async def _stop_now(self, why: str) -> None:
        logger.info("%s: aborting %d open requests and stopping", why, self.state.engine.num_open_requests)
        await self._abort_open_requests()
        self.should_exit = True

    async def _drain(self) -> None:
        engine = self.state.engine
        logger.info("SIGTERM: not accepting new requests; waiting up to %.0f s for %d open requests",
                    self.drain_timeout, engine.num_open_requests)
        deadline = time.monotonic() + self.drain_timeout
        while engine.num_open_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_open_requests:
            logger.warning("drain timeout: aborting %d open requests", engine.num_open_requests)
            await self._abort_open_requests()
        self.should_exit = True

    async def _abort_open_requests(self) -> None:
        """End every open request with finish_reason "abort" and give the handlers up to 1 s to write their last
        chunks."""
        engine = self.state.engine
        if not engine.num_open_requests:
            return
        engine.finish_all_aborted()
        deadline = time.monotonic() + 1.0
        while engine.num_open_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)

    def exit_later(self, delay_s: float) -> None:
        asyncio.get_event_loop().call_later(delay_s, setattr, self, "should_exit", True)
