"""AsyncLLM's utility calls to its engine cores (vLLM's EngineCoreClient `reset_prefix_cache`, `sleep`, `wake_up`,
`is_sleeping`): each goes to every data-parallel replica at once and runs in its busy loop between steps.

While the engines sleep (from the first sleep call until a wake_up that brings everything back) the hang watchdog
does not count: requests that arrive wait in the engines' queues for wake_up, as vLLM's do, and no step runs.
"""

from __future__ import annotations

import asyncio
import time

from pagedllm.engine.core_client import EngineCoreClient
from pagedllm.messages import UtilityResult
from pagedllm.metrics.prometheus import PrometheusStatLogger


class UtilityCallRefused(ValueError):
    """The engine core refused the call (its message says why; nothing changed): HTTP 400."""


class UtilityCalls:
    """Mixed into AsyncLLM (which provides `clients`, `prometheus` and `last_progress_time`)."""

    clients: list[EngineCoreClient]
    prometheus: PrometheusStatLogger
    sleeping: bool = False
    """Between sleep() and a wake_up() that returned True: the watchdog does not count."""

    async def reset_prefix_cache(self) -> bool:
        """Forget every replica's cached prefixes; False if a request holds blocks in any of them (vLLM's
        answer: retry when idle)."""
        return all(r.result for r in await self._call_all("reset_prefix_cache", 60.0))

    async def sleep(self, level: int = 1) -> None:
        """Put every replica to sleep (engine/sleep_mode.py): the requests still open end with finish_reason
        "abort". Raises UtilityCallRefused (level out of range, or >= 1 without --enable-sleep-mode)."""
        was_sleeping, self.sleeping = self.sleeping, True
        try:
            await self._call_all("sleep", None, level)
        except UtilityCallRefused:
            self.sleeping = was_sleeping
            raise
        self.prometheus.record_sleep_state(True, level)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back `tags` (None: all) on every replica; True once every replica is fully awake."""
        awake = all(r.result for r in await self._call_all("wake_up", None, *(tags or ())))
        if awake:
            self.last_progress_time = [time.monotonic()] * len(self.clients)  # the watchdog counts from now
            self.sleeping = False
            self.prometheus.record_sleep_state()
        return awake

    async def is_sleeping(self) -> bool:
        """Whether any replica sleeps (at any level)."""
        return any(r.result for r in await self._call_all("is_sleeping", 10.0))

    async def _call_all(self, method: str, timeout_s: float | None, *args: int | str) -> list[UtilityResult]:
        results = await asyncio.gather(*(client.call_utility(method, timeout_s, *args) for client in self.clients))
        refused = next((r.error for r in results if r.error is not None), None)
        if refused is not None:
            raise UtilityCallRefused(refused)
        return list(results)
