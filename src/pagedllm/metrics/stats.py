"""Statistics the engine core reports each step; pure msgspec so they cross the process boundary."""

from __future__ import annotations

import msgspec


class SpecDecodingStats(msgspec.Struct, kw_only=True):
    """Drafts verified since the last snapshot (vLLM's spec_decode counters)."""

    num_spec_tokens: int = 0
    """Most drafts per request per step (num_speculative_tokens): the length of num_accepted_tokens_per_pos."""
    num_drafts: int = 0
    """Requests that had drafts verified (one per request per step)."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []
    """[num_spec_tokens]: drafts accepted at each position of a draft run."""

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1


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
    spec_decoding_stats: SpecDecodingStats | None = None
    """Speculative decoding counters since the last snapshot; None when speculation is off."""
    total_ref_cnt: int | None = None
    """Sum of every block's ref_cnt (0 when nothing holds a block). Filled only by the debug `stats` utility:
    it walks the whole pool, too slow for every step."""
