"""BlockPool: owns every KV-cache block, the free queue and the prefix-cache hash map.

Only this module changes `ref_cnt`, the free queue or the hash map. Invariants it keeps:
- a block is in the free queue exactly when its ref_cnt is 0;
- `block.block_hash` is set exactly when the hash map maps that hash to that block;
- free queue order is eviction order: least recently freed first.

Block 0 is reserved only for the hybrid manager (`reserve_null_block`): it is the "null block" a sliding
group's table points at for blocks outside its window (never written, never freed, never cached). A model with
one full-attention group reserves nothing: every block id in [0, num_blocks) can hold a request's KV.

The hybrid manager's groups cache the same token hashes each under its own key (the hash plus the group's id byte,
`group_key`); KV events report one group's blocks only (`event_group_id`: the manager picks a full-attention group,
whose chain caps every prefix hit), under the plain hash, so consumers see each block once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pagedllm.core.block_hash import BlockHash
from pagedllm.core.kv_events import KVEventQueue

NULL_BLOCK_HASH = b"null block"
"""The null block's block_hash: set, so caching skips it as "already registered"; never a key of the map."""


def group_key(block_hash: BlockHash, group_id: int) -> BlockHash:
    """The prefix-cache key of `block_hash` in KV cache group `group_id` (hybrid manager only)."""
    return block_hash + bytes((group_id,))


class KVCacheBlock:
    """One physical block of `block_size` token slots in every layer's KV tensor."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        """Set while the block is in the prefix cache (full, hashed, and the map points here)."""
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        short = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={short})"


class FreeKVCacheBlockQueue:
    """Intrusive doubly linked list of free blocks: O(1) popleft, append and remove from the middle.

    The links live in the blocks themselves (`prev_free_block`/`next_free_block`), so removing a
    block touched by a prefix hit needs no search. The head is evicted first.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]):
        self.num_free_blocks = 0
        self._head: KVCacheBlock | None = None
        self._tail: KVCacheBlock | None = None
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the least recently freed block. Raises ValueError when empty."""
        block = self._head
        if block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block`, which must be in this queue."""
        prev_block, next_block = block.prev_free_block, block.next_free_block
        if prev_block is None:
            self._head = next_block
        else:
            prev_block.next_free_block = next_block
        if next_block is None:
            self._tail = prev_block
        else:
            next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail (evicted last)."""
        block.prev_free_block = self._tail
        block.next_free_block = None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free_block = block
        self._tail = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, head (next to evict) first. O(n): for tests and debugging."""
        out = []
        block = self._head
        while block is not None:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """Every KV-cache block, the free queue and the prefix-cache map from block hash to block.

    Args:
        num_blocks: blocks in the pool (ids 0 .. num_blocks-1, none reserved).
        enable_caching: keep full blocks findable by hash after they are freed.
        kv_events: where to record what enters and leaves the prefix cache (core/kv_events.py); None (the
            default): nothing is recorded.
        reserve_null_block: keep block 0 out of use as the null block (`null_block`; hybrid manager only).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, kv_events: KVEventQueue | None = None,
                 reserve_null_block: bool = False):
        if num_blocks < 1 + reserve_null_block:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block: KVCacheBlock | None = None
        if reserve_null_block:
            self.null_block = self.blocks[0]
            self.null_block.ref_cnt = 1  # never in the free queue
            self.null_block.block_hash = NULL_BLOCK_HASH
        self.num_usable_blocks = num_blocks - reserve_null_block
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[reserve_null_block:])
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.kv_events = kv_events
        self.event_group_id = 0
        """The hybrid manager's group whose blocks KV events report (the others' are not reported)."""

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The cached block with this hash, or None. Does not change ref counts."""
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit that was free leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` blocks from the head of the free queue, each with ref_cnt 1.

        A popped block that was cached loses its hash now (lazy eviction). Raises ValueError when
        fewer than `num_blocks` blocks are free.
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks: only "
                             f"{self.free_block_queue.num_free_blocks} are free.")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        key: BlockHash = block.block_hash  # type: ignore[assignment]
        del self.cached_block_hash_to_block[key]
        if self.kv_events is not None and (len(key) == 32 or key[32] == self.event_group_id):  # plain, or reported
            self.kv_events.record_removed(key[:32])
        block.block_hash = None

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue's tail in order.

        Callers pass a request's blocks tail first, so its last blocks are evicted before its prefix.
        """
        append = self.free_block_queue.append
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than it was taken.")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                append(block)

    def cache_full_blocks(
        self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash], start: int, end: int,
        token_ids: Sequence[int] = (), cache_salt: str | None = None, group_id: int | None = None,
    ) -> None:
        """Register blocks[start:end] (full, KV computed) under block_hashes[start:end].

        A block whose hash is already cached by another block (two requests computed the same prefix
        at once) stays uncached: the map keeps one block per hash, and this copy is reused normally.
        token_ids (the request's tokens) and cache_salt are read only to record KV events. group_id: the hybrid
        manager's group, whose key is group_key(hash, group_id) (None: the plain hash).
        """
        if not self.enable_caching:
            return
        table = self.cached_block_hash_to_block
        events = self.kv_events if group_id is None or group_id == self.event_group_id else None
        registered: list[int] | None = None if events is None else []  # for KV events only
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None:
                continue  # a prefix-cache hit, already registered (or the null block)
            block_hash = block_hashes[i] if group_id is None else group_key(block_hashes[i], group_id)
            if block_hash not in table:
                block.block_hash = block_hash
                table[block_hash] = block
                if registered is not None:
                    registered.append(i)
        if registered:
            events.record_stored(block_hashes, registered, token_ids, cache_salt)  # type: ignore[union-attr]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash if no block is in use. Returns whether it did."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.kv_events is not None:
            self.kv_events.record_cleared()
        return True

    def get_num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0 (cached or not): what an allocation can use."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_usable_blocks
