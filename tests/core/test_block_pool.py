import pytest

from pagedllm.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_popleft_append_remove_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])
    assert ids(queue.get_all_free_blocks()) == [0, 1, 3, 4]
    assert blocks[1].next_free_block is blocks[3] and blocks[3].prev_free_block is blocks[1]
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[4])  # the tail
    queue.append(blocks[2])
    assert ids(queue.get_all_free_blocks()) == [1, 3, 2]
    assert queue.num_free_blocks == 3
    for expected in (1, 3, 2):
        assert queue.popleft().block_id == expected
    assert queue.num_free_blocks == 0
    with pytest.raises(ValueError):
        queue.popleft()
    queue.append(blocks[4])
    assert ids(queue.get_all_free_blocks()) == [4]


def test_get_new_blocks_and_free_order():
    pool = BlockPool(6, enable_caching=True)
    a = pool.get_new_blocks(3)
    assert ids(a) == [0, 1, 2] and all(b.ref_cnt == 1 for b in a)
    assert pool.get_num_free_blocks() == 3
    assert pool.get_usage() == pytest.approx(0.5)
    pool.free_blocks(reversed(a))  # tail first
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 4, 5, 2, 1, 0]
    with pytest.raises(ValueError):
        pool.get_new_blocks(7)
    with pytest.raises(ValueError):
        pool.free_blocks([a[0]])  # ref_cnt already 0


def test_cache_touch_and_lazy_eviction():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"h0", b"h1"], 0, 2)
    assert pool.get_cached_block(b"h0") is blocks[0] and blocks[1].block_hash == b"h1"
    pool.free_blocks(reversed(blocks))
    # Freed but still cached, until popped for reuse.
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [2, 3, 1, 0]
    assert pool.get_cached_block(b"h1") is blocks[1]
    pool.touch([blocks[0]])  # a hit on a free block takes it out of the free queue
    assert blocks[0].ref_cnt == 1
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [2, 3, 1]
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 2 and pool.get_num_free_blocks() == 3
    new = pool.get_new_blocks(3)
    assert ids(new) == [2, 3, 1]
    assert blocks[1].block_hash is None and pool.get_cached_block(b"h1") is None  # evicted on reuse
    assert pool.get_cached_block(b"h0") is blocks[0]


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"h"], 0, 1)
    pool.cache_full_blocks([b], [b"h"], 0, 1)
    assert pool.get_cached_block(b"h") is a and b.block_hash is None


def test_caching_disabled_registers_nothing():
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [b"h"], 0, 1)
    assert pool.get_cached_block(b"h") is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2, enable_caching=True)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [b"h"], 0, 1)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"h") is None and blocks[0].block_hash is None


def test_block_zero_is_not_reserved():
    pool = BlockPool(3, enable_caching=True)
    assert ids(pool.get_new_blocks(3)) == [0, 1, 2]
    with pytest.raises(ValueError):
        BlockPool(0, enable_caching=True)
