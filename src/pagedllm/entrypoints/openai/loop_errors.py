"""The API server loop's repeated error reports (a failed accept when descriptors run out) are logged once per
interval, not once per attempt (before: 111 MB of log in 45 s under a connection flood)."""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)


class RateLimitedLoopErrors:
    """An asyncio exception handler that reports each kind of error at most once per `interval_s`.

    A failed accept (EMFILE: out of descriptors) is reported on one line, without a traceback; asyncio's
    selector loop reports it (and the retries it schedules) hundreds of times a second."""

    def __init__(self, interval_s: float = 10.0):
        self.interval_s = interval_s
        self._last: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exception = context.get("exception")
        message = context.get("message", "")
        if message.startswith("Exception in callback"):
            message = message.split("(", 1)[0]  # the callback's arguments differ between repeats
        key = (message, type(exception).__name__)
        now = time.monotonic()
        if now - self._last.get(key, -self.interval_s) < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        repeats = self._suppressed.pop(key, 0)
        more = f" ({repeats} more like it in the last {self.interval_s:g} s)" if repeats else ""
        if isinstance(exception, OSError) and exception.errno in (errno.EMFILE, errno.ENFILE):
            logger.error("%s: %s%s; new connections wait until descriptors are free", message, exception, more)
        else:
            loop.default_exception_handler({**context, "message": context.get("message", "") + more})
