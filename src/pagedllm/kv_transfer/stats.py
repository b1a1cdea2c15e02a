"""KV connector counters for /metrics: the metric families a connector may report, with vLLM's names.

A connector reports counters as a flat dict (msgpack-able, summed over ranks and steps): key `name` or
`name|label value`, for a family below whose one label takes that value. The scheduler side's counters come from
KVConnectorBase.get_stats (cumulative), the workers' from get_kv_connector_stats (since the last call, summed by
KVOutputAggregator and handed to the scheduler side's update_connector_output, which adds its own to get_stats);
metrics/prometheus.py turns them into counters. Names without a label (the P/D connector's) need no entry.
"""

from __future__ import annotations

CONNECTOR_COUNTERS: dict[str, tuple[str | None, str]] = {
    "vllm:kv_offload_total_bytes": ("transfer_type", "Number of bytes offloaded by KV connector"),
    "vllm:kv_offload_total_time": ("transfer_type", "Total time measured by all KV offloading operations"),
    "vllm:kv_offload_tiering_block_queries": ("tier", "KV offload tier lookups, in blocks (a miss in one tier is "
                                                      "looked up in the next)."),
    "vllm:kv_offload_tiering_block_hits": ("tier", "KV offload tier lookups that found the block, in blocks."),
    "vllm:kv_offload_tiering_read_bytes": ("tier", "Total bytes read from secondary tiers into the engine's KV "
                                                   "cache."),
    "vllm:kv_offload_tiering_write_bytes": ("tier", "Total bytes written to secondary tiers (blocks evicted from "
                                                    "the primary tier)."),
    "pagedllm:kv_offload_load_errors": (None, "KV blocks the offload tier could not load (missing, overwritten "
                                              "or corrupted): recomputed, or the request failed, as "
                                              "kv_load_failure_policy says."),
}
"""name -> (its one label's name or None, documentation)."""
OFFLOAD_COUNTERS = frozenset(name for name in CONNECTOR_COUNTERS if "kv_offload" in name)
"""The OffloadingConnector's (it takes only these from the workers' reports: under MultiConnector every
connector sees every counter)."""


def stat_key(name: str, label: str | None = None) -> str:
    if name not in CONNECTOR_COUNTERS:
        raise KeyError(f"unknown KV connector counter {name!r}")
    return name if label is None else f"{name}|{label}"


def split_stat_key(key: str) -> tuple[str, str | None]:
    name, _, label = key.partition("|")
    return name, label or None


def add_stats(into: dict[str, float], more: dict[str, float] | None) -> None:
    for key, value in (more or {}).items():
        into[key] = into.get(key, 0) + value
