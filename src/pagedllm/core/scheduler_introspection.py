"""What the scheduler tells the engine about itself: stats snapshots, counts and the prefix-cache reset (a base
class of core/scheduler.py's Scheduler, which owns the state read here)."""

from __future__ import annotations

from pagedllm.messages import SchedulerStats, SpecDecodingStats


class SchedulerIntrospection:
    """Scheduler's read-only views (and reset_prefix_cache); the attributes are the Scheduler's."""

    def make_stats(self) -> SchedulerStats:
        """A snapshot; the *_delta counters count since the previous call."""
        kv = self.kv_cache_manager
        totals = (kv.prefix_cache_queries, kv.prefix_cache_hits, self.num_preemptions, self.num_slo_shed)
        deltas = [now - before for now, before in zip(totals, self._last_stats, strict=True)]
        self._last_stats = totals
        spec_stats, self._spec_stats = self._spec_stats, self._new_spec_stats()
        ext_queries, ext_hits = self.kv_transfer.take_external_counts() if self.kv_transfer else (0, 0)
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.block_pool.num_usable_blocks,
            prefix_cache_queries_delta=deltas[0],
            prefix_cache_hits_delta=deltas[1],
            num_preemptions_delta=deltas[2],
            num_slo_shed_delta=deltas[3],
            spec_decoding_stats=spec_stats,
            expert_routed_tokens_delta=self.routed_tokens.take(),
            external_prefix_cache_queries_delta=ext_queries,
            external_prefix_cache_hits_delta=ext_hits,
            kv_connector_stats_delta=self._connector_stats_delta(),
        )

    def _connector_stats_delta(self) -> dict[str, float] | None:
        """The KV connector's counters (get_stats(), cumulative) since the last snapshot; None without one."""
        if self.kv_transfer is None:
            return None
        stats = self.kv_transfer.connector.get_stats()
        last, self._last_connector_stats = self._last_connector_stats, stats
        return {name: value - last.get(name, 0) for name, value in stats.items()}

    def _new_spec_stats(self) -> SpecDecodingStats | None:
        return SpecDecodingStats.for_drafts(self.speculative_config and self.speculative_config.num_speculative_tokens)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or a KV connector's transfers not yet reported (the workers report on steps)."""
        return bool(self.requests) or (self.kv_transfer is not None and self.kv_transfer.pending)

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.kv_cache_manager.block_pool.num_usable_blocks

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes (only when no request holds blocks). Returns success."""
        return self.kv_cache_manager.reset_prefix_cache()
