"""One KV cache group's block tables (the hybrid manager, core/kv_cache_coordinator.py, drives one per group).

A group's table maps logical block i of a request to a physical block, as KVCacheManager's does, over the one
BlockPool every group shares; its prefix-cache keys are the request's block hashes with the group's id
(block_pool.group_key). Two kinds:

- FullAttentionManager: every block stays until the request ends; a prefix hit is the longest cached chain.
- SlidingWindowManager (window W): a query at position p reads keys at positions > p - W, so once the request has
  computed n tokens (its next query is at n), blocks wholly before token n - W + 1 are freed and their table slots
  point at the pool's null block. A freed block keeps its hash while it waits in the free queue, so prefix caching
  still finds it. A prefix hit needs only the blocks that hold the W - 1 tokens before the hit's end: it is found
  from the right, and the blocks before it are null.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.core.block_hash import BlockHash
from pagedllm.core.block_pool import BlockPool, KVCacheBlock, group_key
from pagedllm.math_utils import cdiv


class FullAttentionManager:
    """A full-attention group: blocks held until the request ends."""

    def __init__(self, block_pool: BlockPool, block_size: int, group_id: int):
        self.block_pool = block_pool
        self.block_size = block_size
        self.group_id = group_id
        self.null_block: KVCacheBlock = block_pool.null_block  # type: ignore[assignment]
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        """req_id -> how many leading blocks of its table are registered in the prefix cache (or null)."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> list[KVCacheBlock]:
        """The longest chain of this group's cached blocks from the start, at most max_num_blocks long."""
        lookup = self.block_pool.cached_block_hash_to_block.get
        blocks = []
        for block_hash in block_hashes[:max_num_blocks]:
            block = lookup(group_key(block_hash, self.group_id))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        """Full attention reads every token: nothing to free."""

    def max_blocks_per_request(self, max_model_len: int, max_step_tokens: int) -> int:
        """The most blocks one request holds at once."""
        return cdiv(max_model_len, self.block_size)

    def num_new_blocks(self, req_id: str, num_tokens: int, hits: Sequence[KVCacheBlock]) -> int:
        """Blocks to take from the free queue so the table covers `num_tokens` tokens after `hits` join it."""
        held = self.req_to_blocks.get(req_id)
        return max(cdiv(num_tokens, self.block_size) - (len(held) if held else 0) - len(hits), 0)

    def allocate(self, req_id: str, hits: Sequence[KVCacheBlock], num_new_blocks: int) -> list[KVCacheBlock]:
        """Append `hits` (already touched) and `num_new_blocks` fresh blocks to the table; returns the fresh ones."""
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None:
            blocks = self.req_to_blocks[req_id] = []
            self.num_cached_blocks[req_id] = len(hits)
        blocks.extend(hits)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, req_id: str, block_hashes: Sequence[BlockHash], num_full: int,
                     token_ids: Sequence[int], cache_salt: str | None) -> None:
        """Register the request's first `num_full` blocks (full and computed) under this group's keys."""
        num_cached = self.num_cached_blocks.get(req_id)
        if num_cached is None or num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(self.req_to_blocks[req_id], block_hashes, num_cached, num_full, token_ids,
                                          cache_salt, self.group_id)
        self.num_cached_blocks[req_id] = num_full

    def free(self, req_id: str) -> None:
        """Release the request's blocks, tail first; its null slots are not blocks it holds."""
        blocks = self.req_to_blocks.pop(req_id, None)
        self.num_cached_blocks.pop(req_id, None)
        if blocks:
            null = self.null_block
            self.block_pool.free_blocks(b for b in reversed(blocks) if b is not null)

    def block_ids(self, req_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(req_id, ())]


class SlidingWindowManager(FullAttentionManager):
    """A sliding-window group of `window` tokens: blocks outside every future query's window are freed."""

    def __init__(self, block_pool: BlockPool, block_size: int, group_id: int, window: int):
        super().__init__(block_pool, block_size, group_id)
        self.window = window
        self.num_freed_blocks: dict[str, int] = {}
        """req_id -> how many leading table slots are null (freed, or before a prefix hit)."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> list[KVCacheBlock]:
        """The longest hit of at most max_num_blocks blocks whose last cdiv(W - 1, block_size) blocks are cached
        (what the next query reads), or whose blocks from the start are; the slots before them are null."""
        lookup = self.block_pool.cached_block_hash_to_block.get
        needed = cdiv(self.window - 1, self.block_size)
        blocks: list[KVCacheBlock] = [self.null_block] * max_num_blocks
        run = 0
        for i in range(max_num_blocks - 1, -1, -1):
            block = lookup(group_key(block_hashes[i], self.group_id))
            if block is None:
                run = 0
                continue
            blocks[i] = block
            run += 1
            if run >= needed:
                return blocks[:i + run]
        return blocks[:run]  # the run that starts at block 0 (possibly empty)

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        """Free the blocks wholly before token num_computed_tokens - W + 1 (the next query's first key)."""
        blocks = self.req_to_blocks.get(req_id)
        if not blocks:
            return
        end = min(max(num_computed_tokens - self.window + 1, 0) // self.block_size, len(blocks))
        start = self.num_freed_blocks.get(req_id, 0)
        if end <= start:
            return
        null = self.null_block
        freed = [b for b in blocks[start:end] if b is not null]
        blocks[start:end] = [null] * (end - start)
        self.num_freed_blocks[req_id] = end
        self.block_pool.free_blocks(reversed(freed))

    def max_blocks_per_request(self, max_model_len: int, max_step_tokens: int) -> int:
        """The window before a step, plus the step's own tokens, plus one block of misalignment."""
        return min(cdiv(max_model_len, self.block_size), cdiv(self.window - 1 + max_step_tokens, self.block_size) + 1)

    def allocate(self, req_id: str, hits: Sequence[KVCacheBlock], num_new_blocks: int) -> list[KVCacheBlock]:
        if req_id not in self.req_to_blocks:
            null = self.null_block
            self.num_freed_blocks[req_id] = next((i for i, b in enumerate(hits) if b is not null), len(hits))
        return super().allocate(req_id, hits, num_new_blocks)

    def free(self, req_id: str) -> None:
        self.num_freed_blocks.pop(req_id, None)
        super().free(req_id)


def make_group_manager(block_pool: BlockPool, block_size: int, group_id: int, window: int) -> FullAttentionManager:
    """The manager for one group: full attention for window 0, else a sliding window of `window` tokens."""
    if window > 0:
        return SlidingWindowManager(block_pool, block_size, group_id, window)
    return FullAttentionManager(block_pool, block_size, group_id)
