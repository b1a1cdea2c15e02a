"""OffloadingScheduler: the OffloadingConnector's scheduler side (what to load, what to save, per step).

Loads: after the local prefix hit, the request's next block hashes are looked up in the store (every tensor-
parallel rank's copy must be there); the blocks found are loaded synchronously by the workers at the start of the
step that admits the request (start_load_kv), into the blocks the scheduler allocated for them.

Saves, write-through as vLLM's OffloadingConnector: every block of a running request that becomes full (its
tokens' KV computed by the end of the step, so never a speculative draft's) goes to the workers' save list that
step, local prefix hits and loaded blocks included (a block the store has is only touched: the store's LRU then
follows use, not just first computation). A block evicted from the pool later is thus already in RAM.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from pagedllm.kv_transfer.offloading.store import DISK, RAM, BlockStore
from pagedllm.kv_transfer.stats import stat_key

if TYPE_CHECKING:
    from pagedllm.core.request import Request
    from pagedllm.core.scheduler_output import SchedulerOutput
    from pagedllm.kv_transfer.offloading.spec import OffloadSpec

TIER_LABELS = {RAM: "0:primary", DISK: "1:disk"}
"""vLLM's tier labels ("<index>:<type>", the primary tier 0:primary)."""


@dataclasses.dataclass
class _Lookup:
    start: int
    """The first block looked up (the local hit's end)."""
    tiers: list[int]
    """The tier of each block found, in order."""
    missed: bool
    """The lookup stopped at a block no tier had (not at the end of the hashes)."""


@dataclasses.dataclass
class _Tracked:
    request: Request
    block_ids: list[int]
    next_save: int = 0
    """Blocks before this one were handed to the workers' saves already."""


class OffloadingScheduler:
    def __init__(self, spec: OffloadSpec, block_size: int, tp_size: int):
        self.spec = spec
        self.block_size = block_size
        self.tp_size = tp_size
        self.store: BlockStore | None = None
        """Attached on first use: the workers create the region when their KV cache exists."""
        self._lookups: dict[str, _Lookup] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[tuple[int, bytes]] = []
        self.counters: dict[str, float] = {}

    def _attach(self) -> BlockStore | None:
        if self.store is None:
            self.store = BlockStore.attach(self.spec.path, None, self.spec.disk_dir)
        return self.store

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        store = self._attach()
        start = num_computed_tokens // self.block_size
        hashes = request.block_hashes[start:]
        if store is None or not hashes or request.skip_reading_prefix_cache:  # prompt logprobs, MEAN/CLS pooling
            self._lookups.pop(request.request_id, None)
            return 0, False
        tiers = store.lookup(hashes, self.tp_size)
        self._lookups[request.request_id] = _Lookup(start, tiers, len(tiers) < len(hashes))
        return len(tiers) * self.block_size, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        req_id = request.request_id
        self._tracked[req_id] = _Tracked(request, list(block_ids))
        lookup = self._lookups.pop(req_id, None)
        if lookup is None:
            return
        self._count_lookup(lookup)
        num_blocks = -(-num_external_tokens // self.block_size)
        for i in range(lookup.start, lookup.start + min(num_blocks, len(lookup.tiers))):
            self._loads.append((block_ids[i], request.block_hashes[i]))

    def _count_lookup(self, lookup: _Lookup) -> None:
        in_ram = lookup.tiers.count(RAM)
        on_disk = len(lookup.tiers) - in_ram
        queries = {RAM: len(lookup.tiers) + lookup.missed, DISK: on_disk + lookup.missed}
        hits = {RAM: in_ram, DISK: on_disk}
        tiers = (RAM, DISK) if self.spec.disk_dir else (RAM,)
        for tier in tiers:
            self._add(stat_key("vllm:kv_offload_tiering_block_queries", TIER_LABELS[tier]), queries[tier])
            self._add(stat_key("vllm:kv_offload_tiering_block_hits", TIER_LABELS[tier]), hits[tier])

    def _add(self, key: str, value: float) -> None:
        self.counters[key] = self.counters.get(key, 0) + value

    def build_connector_meta(self, so: SchedulerOutput) -> dict[str, Any]:
        tracked = self._tracked
        for new in so.scheduled_new_reqs:
            state = tracked.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids)
        cached = so.scheduled_cached_reqs
        for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            state = tracked.get(req_id)
            if state is not None and new_block_ids:
                state.block_ids.extend(new_block_ids)
        saves: list[tuple[int, bytes]] = []
        bs = self.block_size
        for req_id, num_scheduled in so.num_scheduled_tokens.items():
            state = tracked.get(req_id)
            if state is None:
                continue
            request = state.request
            full = min((request.num_computed_tokens + num_scheduled) // bs, len(request.block_hashes),
                       len(state.block_ids))
            for i in range(state.next_save, full):
                saves.append((state.block_ids[i], request.block_hashes[i]))
            state.next_save = max(state.next_save, full)
        loads, self._loads = self._loads, []
        return {"load": loads, "save": saves} if loads or saves else {}

    def request_finished(self, request: Request) -> None:
        self._tracked.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)

    def shutdown(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
