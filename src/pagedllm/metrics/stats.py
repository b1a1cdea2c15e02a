"""Statistics the engine core reports each step; pure msgspec so they cross the process boundary."""

from __future__ import annotations

import msgspec


class SchedulerStats(msgspec.Struct, kw_only=True):
    """A snapshot of the scheduler after one step.

    Counters named `*_delta` count events since the previous snapshot (Prometheus counters add them).
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries_delta: int = 0
    """Prompt tokens looked up in the prefix cache since the last snapshot."""
    prefix_cache_hits_delta: int = 0
    """Of those, tokens found cached."""
    num_preemptions_delta: int = 0
    total_ref_cnt: int | None = None
    """Sum of every block's ref_cnt (0 when nothing holds a block). Filled only by the debug `stats` utility:
    it walks the whole pool, too slow for every step."""
