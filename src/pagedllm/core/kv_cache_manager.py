"""KVCacheManager: block tables per request, on-demand allocation and prefix-cache lookups.

A request's block table maps logical block i (tokens i*block_size .. (i+1)*block_size - 1) to a
physical block. Blocks are allocated only when the last one is full. All ref-count and free-queue
changes go through BlockPool.
"""

from __future__ import annotations

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_events import KVCacheEvent, KVEventQueue, int_block_hashes_from_env
from pagedllm.core.request import Request
from pagedllm.math_utils import cdiv


class PooledKVCache:
    """What both KV cache managers (this one and core/kv_cache_coordinator.py's hybrid one) share: one BlockPool,
    the prefix-cache counters, usage and KV events."""

    def _init_pool(self, num_blocks: int, block_size: int, enable_caching: bool, max_model_len: int,
                   enable_kv_cache_events: bool, reserve_null_block: bool = False) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        kv_events = KVEventQueue(block_size, int_block_hashes_from_env()) if enable_kv_cache_events else None
        self.block_pool = BlockPool(num_blocks, enable_caching, kv_events, reserve_null_block)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def _count_first_lookup(self, request: Request, num_hit_tokens: int) -> None:
        if self.enable_caching and request.num_preemptions == 0:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; only possible when no request holds blocks. Returns success."""
        return self.block_pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        """The KV-cache events recorded since the last call ([] when events are off)."""
        kv_events = self.block_pool.kv_events
        return [] if kv_events is None else kv_events.take()


class KVCacheManager(PooledKVCache):
    """Per-request block tables on top of a BlockPool.

    Prefix-cache counters (`prefix_cache_queries`, `prefix_cache_hits`, in tokens, cumulative) count
    a request once, when it is first scheduled: queries += its prompt length, hits += the tokens
    taken from the cache. Lookups that end in a failed allocation, and lookups made when a preempted
    request resumes, are not counted, so hits/queries is the hit rate of admitted prompts.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_caching: prefix caching on/off.
        max_model_len: longest prompt + output; one request never needs more than
            cdiv(max_model_len, block_size) blocks.
        enable_kv_cache_events: record what enters and leaves the prefix cache (core/kv_events.py) for
            take_events(); off: nothing is recorded.

    Raises ValueError when the pool cannot hold one request of max_model_len tokens (the one place this is
    checked: the engine core builds its scheduler, and so this, before it allocates the KV cache).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 max_model_len: int = 8192, enable_kv_cache_events: bool = False):
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}.")
        blocks_per_request = cdiv(max_model_len, block_size)
        if num_blocks < blocks_per_request:
            raise ValueError(
                f"The KV cache holds {num_blocks} blocks ({num_blocks * block_size} tokens), so it cannot hold one "
                f"request of max_model_len={max_model_len} tokens, which needs {blocks_per_request} blocks. Raise "
                "--kv-cache-memory or lower --max-model-len.")
        self._init_pool(num_blocks, block_size, enable_caching, max_model_len, enable_kv_cache_events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        """req_id -> how many leading blocks of its table are registered in the prefix cache."""

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest chain of cached blocks that starts the request's tokens. Changes nothing.

        The hit is capped below the request's last token: that token is always recomputed, so the
        step produces logits to sample from. Example with block_size 4 and a fully cached 8-token
        prompt: only block 0 counts (4 tokens); tokens 4..7 are computed again.

        Args:
            request: a request with num_computed_tokens == 0.

        Returns:
            (cached blocks in order, number of tokens they hold).
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0  # prompt logprobs need every prompt position computed (as vLLM does)
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        lookup = self.block_pool.cached_block_hash_to_block.get
        blocks = []
        for block_hash in request.block_hashes[:max_num_blocks]:
            block = lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request`, taking prefix hits first.

        Nothing changes unless the whole allocation succeeds (hits are touched only then).

        Args:
            request: the request; request.num_computed_tokens tokens already have blocks.
            num_new_tokens: tokens to compute this step (after the prefix hits).
            num_new_computed_tokens: tokens covered by `new_computed_blocks`.
            new_computed_blocks: prefix-cache hits from get_computed_blocks (first scheduling only).

        Returns:
            The newly allocated blocks (possibly []), or None when the pool cannot supply them
            (the caller preempts or waits).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be at least 0, got {num_new_tokens}.")
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id)
        num_tokens_needed = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if (req_blocks is not None and not new_computed_blocks
                and num_tokens_needed <= len(req_blocks) * self.block_size):
            return []  # decode fast path: the last block still has room
        num_held = 0 if req_blocks is None else len(req_blocks)
        num_required_blocks = cdiv(num_tokens_needed, self.block_size)
        if not new_computed_blocks:
            num_new_blocks = num_required_blocks - num_held
            if num_new_blocks > self.block_pool.free_block_queue.num_free_blocks:
                return None
            new_computed_blocks = []
        else:
            num_new_blocks = num_required_blocks - num_held - len(new_computed_blocks)
            # Hits with ref_cnt 0 sit in the free queue: touching them uses up free blocks too.
            num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
            if num_new_blocks > self.block_pool.get_num_free_blocks() - num_free_hits:
                return None
            self.block_pool.touch(new_computed_blocks)
        if req_blocks is None:
            self._count_first_lookup(request, num_new_computed_tokens)
            req_blocks = self.req_to_blocks[req_id] = []
            self.num_cached_blocks[req_id] = len(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full and computed in the prefix cache.

        Call after the step that computed them ran (prefill chunks and decodes alike).

        Args:
            request: a request holding blocks.
            num_computed_tokens: tokens of the request whose KV is now in its blocks.
        """
        req_id = request.request_id
        num_full = min(num_computed_tokens // self.block_size, len(request.block_hashes))
        num_cached = self.num_cached_blocks.get(req_id)
        if num_cached is None or num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(self.req_to_blocks[req_id], request.block_hashes, num_cached,
                                          num_full, request.all_token_ids, request.cache_salt)
        self.num_cached_blocks[req_id] = num_full

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first (its last blocks get evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, req_id: str) -> list[KVCacheBlock]:
        """The request's block table as blocks ([] when it holds none)."""
        return self.req_to_blocks.get(req_id, [])

    @staticmethod
    def new_block_ids(blocks: list[KVCacheBlock]) -> list[int]:
        """allocate_slots' new blocks as the ids the runner appends to the request's table."""
        return [b.block_id for b in blocks]

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's block table as physical block ids ([] when it holds none)."""
        return [block.block_id for block in self.req_to_blocks.get(req_id, ())]
