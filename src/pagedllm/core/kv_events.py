"""KV-cache events: what enters and leaves the prefix cache, in vLLM's wire format, for external routers.

With `--kv-events-config '{"enable_kv_cache_events": true}'` the BlockPool records, as it happens:
- `BlockStored`: full blocks that entered the prefix cache (hashed, findable by later requests), one event per
  contiguous run of a request's blocks, with their token ids and the hash of the block before the run (None
  when the run starts at the request's first block);
- `BlockRemoved`: a cached block that lost its hash because it was popped from the free queue for reuse;
- `AllBlocksCleared`: the prefix cache was reset.
The engine core takes them once per step (`KVEventQueue.take`) and publishes them as one `KVEventBatch`
(engine/kv_event_publisher.py). Disabled (the default), the pool holds no queue and records nothing.

Wire format (vLLM 0.32's `vllm/distributed/kv_events.py`, so vLLM's own subscribers decode it): msgspec
msgpack; a batch is an array `[ts, events, data_parallel_rank]`; each event is a map tagged with its class name
under "type", fields in the order below, `None` defaults left out. A block hash is published as vLLM publishes
its own by default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`): an unsigned 64-bit int, the last 8 bytes of the
block's SHA-256 digest read big-endian (core/block_hash.py: chained over the parent's hash, the block's tokens
and, for a request's first block, its cache_salt). `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` publishes the whole
32-byte digest instead. Either way the values are pagedllm's own hashes: a router that recomputes vLLM's hash
from token ids will not find them; one that tracks the published values (or the token ids) will.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from pagedllm import envs
from pagedllm.core.block_hash import BlockHash

ExternalBlockHash = int | bytes
"""A block hash as published: a 64-bit int (the default) or the 32-byte digest."""

MEDIUM_GPU = "GPU"
"""vLLM's name for the engine's own KV cache (its CPU build publishes it too); consumers filter on it."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Every event of one engine step."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events; encoded as a map whose "type" is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    """One entry per block: (cache_salt,) for a salted request's first block, else None; absent without a salt."""
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def int_block_hashes_from_env() -> bool:
    """vLLM's switch: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 publishes whole digests, anything else 64-bit ints."""
    return envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES


class KVEventQueue:
    """The events the BlockPool recorded since the engine core last took them.

    Args:
        block_size: tokens per block (every BlockStored carries it).
        int_hashes: publish hashes as 64-bit ints (vLLM's default) instead of 32-byte digests.
    """

    def __init__(self, block_size: int, int_hashes: bool = True):
        self.block_size = block_size
        self.int_hashes = int_hashes
        self.events: list[KVCacheEvent] = []

    def external_hash(self, block_hash: BlockHash) -> ExternalBlockHash:
        """The published form of a hash: the digest's last 8 bytes as a big-endian uint64, or the digest."""
        return int.from_bytes(block_hash[-8:], "big") if self.int_hashes else block_hash

    def record_stored(self, block_hashes: Sequence[BlockHash], indices: Sequence[int], token_ids: Sequence[int],
                      cache_salt: str | None) -> None:
        """Blocks `indices` (ascending) of a request entered the prefix cache: one BlockStored per contiguous run.

        Args:
            block_hashes: the request's block hashes (one per full block).
            indices: which of its blocks were newly registered.
            token_ids: the request's tokens (at least up to the last of those blocks).
            cache_salt: the request's salt (it entered block 0's hash).
        """
        start = indices[0]
        for previous, i in zip(indices, indices[1:], strict=False):
            if i != previous + 1:  # a gap: that block's hash was already cached by another block
                self._append_run(block_hashes, start, previous + 1, token_ids, cache_salt)
                start = i
        self._append_run(block_hashes, start, indices[-1] + 1, token_ids, cache_salt)

    def _append_run(self, block_hashes: Sequence[BlockHash], start: int, end: int, token_ids: Sequence[int],
                    cache_salt: str | None) -> None:
        size = self.block_size
        extra_keys = None
        if cache_salt is not None and start == 0:
            extra_keys = [(cache_salt,)] + [None] * (end - 1)
        self.events.append(BlockStored(
            block_hashes=[self.external_hash(h) for h in block_hashes[start:end]],
            parent_block_hash=self.external_hash(block_hashes[start - 1]) if start > 0 else None,
            token_ids=list(token_ids[start * size:end * size]),
            block_size=size, lora_id=None, medium=MEDIUM_GPU, lora_name=None, extra_keys=extra_keys, group_idx=0))

    def record_removed(self, block_hash: BlockHash) -> None:
        """A cached block was evicted (popped for reuse): its hash leaves the prefix cache."""
        self.events.append(BlockRemoved(block_hashes=[self.external_hash(block_hash)], medium=MEDIUM_GPU,
                                        group_idx=0))

    def record_cleared(self) -> None:
        """The whole prefix cache was reset."""
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """Every event recorded since the last call, oldest first; the queue is left empty."""
        events, self.events = self.events, []
        return events
