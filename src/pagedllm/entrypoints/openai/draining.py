"""DrainingServer: uvicorn's server, with a first SIGTERM that drains instead of closing at once."""

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
    """uvicorn, except that the first SIGTERM drains instead of closing the listening socket."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float):
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self._drain_task: asyncio.Task | None = None

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
        if sig == signal.SIGTERM and not self.state.draining:
            self.state.draining = True
            loop = asyncio.get_event_loop()
            loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        engine = self.state.engine
        logger.info("SIGTERM: not accepting new requests; waiting up to %.0f s for %d open requests",
                    self.drain_timeout, engine.num_open_requests)
        deadline = time.monotonic() + self.drain_timeout
        while engine.num_open_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_open_requests:
            logger.warning("drain timeout: aborting %d open requests", engine.num_open_requests)
            engine.finish_all_aborted()  # each ends with finish_reason "abort"
            deadline = time.monotonic() + 1.0  # let the handlers write their last chunks
            while engine.num_open_requests and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)
        self.should_exit = True

    def exit_later(self, delay_s: float) -> None:
        asyncio.get_event_loop().call_later(delay_s, setattr, self, "should_exit", True)
