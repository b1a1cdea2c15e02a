from pagedllm.core.kv_cache_manager import KVCacheManager

from .utils import create_requests


def ids(blocks):
    return [b.block_id for b in blocks]


def free_ids(manager):
    return ids(manager.block_pool.free_block_queue.get_all_free_blocks())


def run_prefill(manager, request):
    """Allocate the whole prompt after a lookup, as the scheduler does, and mark it computed."""
    hits, num_hit = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)
    return hits, new


def test_prefix_hit_exact_blocks_ref_counts_and_free_queue():
    manager = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True, max_model_len=40)
    a, b = create_requests(2, num_tokens=10, block_size=4, same_prompt=True)
    hits, new = run_prefill(manager, a)
    assert hits == [] and ids(new) == [0, 1, 2]
    assert manager.get_block_ids("0") == [0, 1, 2]
    # Blocks 0 and 1 are full and registered; block 2 holds tokens 8, 9 only.
    pool = manager.block_pool
    assert [pool.blocks[i].block_hash for i in range(3)] == a.block_hashes + [None]

    hits, num_hit = manager.get_computed_blocks(b)
    assert ids(hits) == [0, 1] and num_hit == 8
    new = manager.allocate_slots(b, 2, num_hit, hits)
    assert ids(new) == [3]
    assert [pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert manager.get_block_ids("1") == [0, 1, 3]

    manager.free(a)
    assert [pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 2]
    manager.free(b)
    # Reverse order: b's tail (3) first, then its prefix 1, 0.
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    assert all(blk.ref_cnt == 0 for blk in pool.blocks)
    assert manager.prefix_cache_queries == 20 and manager.prefix_cache_hits == 8


def test_last_token_is_always_recomputed():
    manager = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True, max_model_len=40)
    a, b = create_requests(2, num_tokens=8, block_size=4, same_prompt=True)
    run_prefill(manager, a)
    manager.free(a)
    hits, num_hit = manager.get_computed_blocks(b)
    assert ids(hits) == [0] and num_hit == 4  # block 1 is cached but holds the last token


def test_hit_on_free_block_is_touched_only_if_allocation_succeeds():
    manager = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True, max_model_len=16)
    (a,) = create_requests(1, num_tokens=9, block_size=4)
    run_prefill(manager, a)  # blocks 0, 1 cached, 2 partial
    manager.free(a)
    assert free_ids(manager) == [3, 2, 1, 0]
    (b,) = create_requests(1, prompt_token_ids=a.prompt_token_ids + [77] * 7, block_size=4, id_prefix="b")
    hits, num_hit = manager.get_computed_blocks(b)
    assert ids(hits) == [0, 1] and num_hit == 8
    # 16 tokens need 4 blocks: 2 hits (both in the free queue) + 2 new > 4 free - 2 hits -> fails.
    (c,) = create_requests(1, num_tokens=4, block_size=4, id_prefix="c")
    assert manager.allocate_slots(c, 4) is not None  # takes block 3
    assert manager.allocate_slots(b, 8, num_hit, hits) is None
    assert [blk.ref_cnt for blk in manager.block_pool.blocks] == [0, 0, 0, 1]
    assert free_ids(manager) == [2, 1, 0]
    assert manager.prefix_cache_queries == 9 + 4  # b not counted: never admitted
    manager.free(c)
    new = manager.allocate_slots(b, 8, num_hit, hits)
    assert ids(new) == [2, 3]
    assert manager.get_block_ids("b0") == [0, 1, 2, 3]
    assert manager.prefix_cache_hits == 8


def test_eviction_is_lazy_and_lru():
    manager = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True, max_model_len=8)
    a, b = create_requests(2, num_tokens=4, block_size=2)
    run_prefill(manager, a)  # blocks 0, 1
    manager.free(a)  # free queue: 2, 3, 1, 0; blocks 0, 1 keep their hashes
    run_prefill(manager, b)  # takes 2, 3
    (c,) = create_requests(1, num_tokens=3, block_size=2, id_prefix="c")
    new = manager.allocate_slots(c, 3)
    assert ids(new) == [1, 0]  # a's tail evicted first
    pool = manager.block_pool
    assert pool.get_cached_block(a.block_hashes[0]) is None
    assert pool.get_cached_block(a.block_hashes[1]) is None


def test_decode_fills_blocks_that_get_cached():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True, max_model_len=32)
    (a,) = create_requests(1, num_tokens=3, block_size=4)
    run_prefill(manager, a)
    assert manager.block_pool.cached_block_hash_to_block == {}
    a.append_output_token_ids(5)  # token 3 (fills block 0 once computed)
    assert manager.allocate_slots(a, 1) == []  # still room in block 0
    a.num_computed_tokens += 1
    manager.cache_blocks(a, a.num_computed_tokens)
    assert manager.block_pool.get_cached_block(a.block_hashes[0]).block_id == 0
    a.append_output_token_ids(6)
    assert ids(manager.allocate_slots(a, 1)) == [1]


def test_caching_disabled():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False, max_model_len=32)
    a, b = create_requests(2, num_tokens=9, block_size=4, same_prompt=True)
    run_prefill(manager, a)
    assert manager.get_computed_blocks(b) == ([], 0)
    assert manager.prefix_cache_queries == 0
    assert manager.usage == 3 / 8


def test_prompt_logprobs_request_skips_the_prefix_cache():
    """Prompt logprobs need logits at every prompt position, so such a request computes them all."""
    import msgspec

    manager = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True, max_model_len=40)
    a, b = create_requests(2, num_tokens=10, block_size=4, same_prompt=True)
    run_prefill(manager, a)
    b.sampling_params = msgspec.structs.replace(b.sampling_params, prompt_logprobs=2)
    assert manager.get_computed_blocks(b) == ([], 0)
