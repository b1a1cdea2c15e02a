"""HybridKVCacheManager: the KV cache manager of a model with sliding-window layers (vLLM's hybrid KV cache manager).

A coordinator over one manager per KV cache group (core/kv_cache_spec.py: full attention or a sliding window),
all on one BlockPool whose block 0 is the null block. The scheduler sees KVCacheManager's interface; what differs:

- a request holds one block table per group; the groups' tables grow together (one length), so block ids travel as
  one list, group after group (`get_block_ids`, `new_block_ids`: [group 0's ids, then group 1's, ...], which the
  runner's InputBatch splits in equal parts);
- before each allocation, every sliding group frees the request's blocks wholly outside its window (their slots
  become the null block; the runner's table keeps the old ids, which no kernel reads: every attention path reads a
  windowed layer's keys from the window only, or masks the rest);
- a prefix hit must satisfy every group: the full groups' longest chain caps the sliding groups' hits, each of those
  caps the others, until all agree (a full group's hit is any prefix of its chain; a sliding group's is not);
- admission and preemption count the blocks of every group together;
- KV events report one group's blocks (a full-attention one where there is one: it holds every block of a prefix
  and its chain caps every hit), so a consumer sees each block once.
"""

from __future__ import annotations

from pagedllm.core.block_pool import KVCacheBlock
from pagedllm.core.kv_cache_manager import KVCacheManager, PooledKVCache
from pagedllm.core.kv_cache_spec import KVCacheLayout
from pagedllm.core.request import Request
from pagedllm.core.single_type_kv_cache_manager import make_group_manager

GroupBlocks = list[list[KVCacheBlock]]
"""Blocks per KV cache group, in group order."""


class HybridKVCacheManager(PooledKVCache):
    """Per-group block tables over one BlockPool (KVCacheManager's interface; the module docstring says how it
    differs).

    Args:
        layout: the model's KV cache groups (at least one with a window).
        num_blocks: blocks in the pool, the null block included.
        block_size, enable_caching, max_model_len, enable_kv_cache_events: as KVCacheManager's.
        max_step_tokens: the most tokens one request computes in a step (the scheduler's token budget): a sliding
            group holds its window plus a step's tokens.

    Raises ValueError when the pool cannot hold one request of max_model_len tokens.
    """

    def __init__(self, layout: KVCacheLayout, num_blocks: int, block_size: int, enable_caching: bool = True,
                 max_model_len: int = 8192, enable_kv_cache_events: bool = False, max_step_tokens: int = 8192):
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}.")
        self._init_pool(num_blocks, block_size, enable_caching, max_model_len, enable_kv_cache_events,
                        reserve_null_block=True)
        self.groups = [make_group_manager(self.block_pool, block_size, g, spec.window)
                       for g, spec in enumerate(layout.groups)]
        self.block_pool.event_group_id = next((g for g, spec in enumerate(layout.groups) if spec.window == 0), 0)
        blocks_per_request = sum(m.max_blocks_per_request(max_model_len, max_step_tokens) for m in self.groups)
        if self.block_pool.num_usable_blocks < blocks_per_request:
            raise ValueError(
                f"The KV cache holds {num_blocks} blocks of {layout.group_size} layers, so it cannot hold one request "
                f"of max_model_len={max_model_len} tokens, which needs {blocks_per_request} blocks over "
                f"{len(self.groups)} KV cache groups. Raise --kv-cache-memory or lower --max-model-len.")
        self._first = self.groups[0]

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The longest prefix every group has cached (capped below the last token, as KVCacheManager's).

        Returns:
            (each group's hit blocks, null slots included, all of one length; the tokens they hold)."""
        no_hit: GroupBlocks = [[] for _ in self.groups]
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return no_hit, 0
        num_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes
        hits: GroupBlocks = no_hit
        changed = True
        while changed and num_blocks > 0:
            changed = False
            for g, manager in enumerate(self.groups):
                found = manager.find_longest_cache_hit(hashes, num_blocks)
                hits[g] = found
                if len(found) < num_blocks:
                    num_blocks = len(found)
                    changed = g > 0  # the groups before this one found more than it: look again with its cap
        return [blocks[:num_blocks] for blocks in hits], num_blocks * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: GroupBlocks | None = None) -> GroupBlocks | list | None:
        """Make room for `num_new_tokens` more tokens in every group, taking prefix hits first; sliding groups first
        free the blocks the request no longer reads (always, whatever follows); nothing else changes unless the whole
        allocation succeeds.

        Returns:
            The new blocks per group, [] when no group needed one, or None when the pool cannot supply them."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be at least 0, got {num_new_tokens}.")
        req_id = request.request_id
        groups = self.groups
        for manager in groups:
            manager.remove_skipped_blocks(req_id, request.num_computed_tokens)
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        held = self._first.req_to_blocks.get(req_id)
        if held is not None and not new_computed_blocks and num_tokens <= len(held) * self.block_size:
            return []  # decode fast path: every group's last block still has room (the tables grow together)
        hits = new_computed_blocks if new_computed_blocks and any(new_computed_blocks) else None
        no_hits: list[KVCacheBlock] = []
        counts = [m.num_new_blocks(req_id, num_tokens, hits[g] if hits else no_hits) for g, m in enumerate(groups)]
        free = self.block_pool.get_num_free_blocks()
        if hits:
            null = self.block_pool.null_block
            touched = [b for blocks in hits for b in blocks if b is not null]
            free -= sum(1 for b in touched if b.ref_cnt == 0)  # a hit waiting in the free queue uses a free block
            if sum(counts) > free:
                return None
            self.block_pool.touch(touched)
        elif sum(counts) > free:
            return None
        if held is None:
            self._count_first_lookup(request, num_new_computed_tokens)
        new_blocks = [m.allocate(req_id, hits[g] if hits else no_hits, counts[g]) for g, m in enumerate(groups)]
        return new_blocks if any(new_blocks) else []

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register every group's blocks that are full and computed (null slots stay out)."""
        num_full = min(num_computed_tokens // self.block_size, len(request.block_hashes))
        for manager in self.groups:
            manager.cache_blocks(request.request_id, request.block_hashes, num_full, request.all_token_ids,
                                 request.cache_salt)

    def free(self, request: Request) -> None:
        for manager in self.groups:
            manager.free(request.request_id)

    @staticmethod
    def new_block_ids(blocks: GroupBlocks) -> list[int]:
        """allocate_slots' new blocks as the ids the runner appends to the groups' tables, group after group."""
        return [b.block_id for group in blocks for b in group]

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's block tables as physical block ids, group after group (null slots: the null block's id)."""
        return [block_id for manager in self.groups for block_id in manager.block_ids(req_id)]

    def num_blocks_held(self, req_id: str) -> list[int]:
        """Blocks the request holds in each group, null slots excluded (the KV economy benchmark reads this)."""
        null = self.block_pool.null_block
        return [sum(1 for b in m.req_to_blocks.get(req_id, ()) if b is not null) for m in self.groups]


AnyKVCacheManager = KVCacheManager | HybridKVCacheManager


def make_kv_cache_manager(layout: KVCacheLayout | None, num_blocks: int, block_size: int, enable_caching: bool,
                          max_model_len: int, enable_kv_cache_events: bool, max_step_tokens: int) -> AnyKVCacheManager:
    """The hybrid manager for a layout with a sliding window, else the plain one (one full-attention group, or no
    layout given)."""
    if layout is not None and layout.is_hybrid:
        return HybridKVCacheManager(layout, num_blocks, block_size, enable_caching, max_model_len,
                                    enable_kv_cache_events, max_step_tokens)
    return KVCacheManager(num_blocks, block_size, enable_caching, max_model_len, enable_kv_cache_events)
