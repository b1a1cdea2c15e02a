"""KV-cache events recorded by the block pool, without a model: BlockStored when full blocks enter the prefix
cache (hashes as the request computes them, cache_salt included), BlockRemoved when a cached block is evicted,
AllBlocksCleared on reset, nothing at all when events are off."""

from __future__ import annotations

import pytest

from pagedllm.core.block_hash import NONE_HASH, hash_block_tokens
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventQueue

from .utils import create_requests


def ext(block_hash: bytes) -> int:
    """vLLM's default published form: the digest's low 64 bits (last 8 bytes, big-endian)."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def stored(hashes, parent, token_ids, block_size=4, extra_keys=None):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=token_ids, block_size=block_size,
                       lora_id=None, medium="GPU", lora_name=None, extra_keys=extra_keys, group_idx=0)


def removed(block_hash):
    return BlockRemoved(block_hashes=[block_hash], medium="GPU", group_idx=0)


def prefill(manager, request):
    hits, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits) is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)


def test_stored_on_full_blocks_removed_on_eviction_cleared_on_reset():
    manager = KVCacheManager(num_blocks=4, block_size=4, max_model_len=16, enable_kv_cache_events=True)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    (a,) = create_requests(1, block_size=4, prompt_token_ids=prompt, cache_salt="tenant-a")
    prefill(manager, a)
    h0 = hash_block_tokens(NONE_HASH, prompt[0:4], "tenant-a")  # the salt enters block 0's hash only
    h1 = hash_block_tokens(h0, prompt[4:8])
    assert h0 != hash_block_tokens(NONE_HASH, prompt[0:4])
    assert manager.take_events() == [stored([ext(h0), ext(h1)], None, prompt[:8], extra_keys=[("tenant-a",), None])]
    assert manager.take_events() == []  # taken once

    a.append_output_token_id(11)
    a.append_output_token_id(12)  # block 2 is full now
    assert manager.allocate_slots(a, 2) == []
    a.num_computed_tokens = 12
    manager.cache_blocks(a, 12)
    h2 = hash_block_tokens(h1, [9, 10, 11, 12])
    assert manager.take_events() == [stored([ext(h2)], ext(h1), [9, 10, 11, 12])]

    manager.free(a)  # freed blocks keep their hashes: nothing leaves the cache yet
    assert manager.take_events() == []
    (b,) = create_requests(1, block_size=4, prompt_token_ids=list(range(100, 116)))
    prefill(manager, b)  # needs all 4 blocks: evicts a's three, tail first (free-queue order)
    b_hashes = [ext(h) for h in b.block_hashes]
    assert manager.take_events() == [removed(ext(h2)), removed(ext(h1)), removed(ext(h0)),
                                     stored(b_hashes, None, list(range(100, 116)))]

    assert not manager.reset_prefix_cache()  # b holds blocks: refused, no event
    assert manager.take_events() == []
    manager.free(b)
    assert manager.reset_prefix_cache()
    assert manager.take_events() == [AllBlocksCleared()]


def test_a_block_cached_by_another_request_is_left_out():
    manager = KVCacheManager(num_blocks=8, block_size=4, max_model_len=16, enable_kv_cache_events=True)
    a, b = create_requests(2, block_size=4, prompt_token_ids=list(range(1, 10)))
    for request in (a, b):  # both allocated before either is cached: no prefix hit
        assert manager.allocate_slots(request, request.num_tokens) is not None
        request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(a, 9)
    assert [e.block_hashes for e in manager.take_events()] == [[ext(h) for h in a.block_hashes]]
    manager.cache_blocks(b, 9)  # same hashes, already cached by a's blocks
    assert manager.take_events() == []


def test_runs_split_at_blocks_already_cached():
    queue = KVEventQueue(block_size=2)
    hashes = [bytes([i]) * 32 for i in range(4)]
    queue.record_stored(hashes, [0, 2, 3], token_ids=list(range(8)), cache_salt="s")
    assert queue.take() == [
        stored([ext(hashes[0])], None, [0, 1], block_size=2, extra_keys=[("s",)]),
        stored([ext(hashes[2]), ext(hashes[3])], ext(hashes[1]), [4, 5, 6, 7], block_size=2),
    ]


def test_digests_when_vllm_int_hashes_are_off(monkeypatch):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    manager = KVCacheManager(num_blocks=4, block_size=4, max_model_len=16, enable_kv_cache_events=True)
    (a,) = create_requests(1, block_size=4, prompt_token_ids=list(range(1, 10)))
    prefill(manager, a)
    (event,) = manager.take_events()
    assert event.block_hashes == a.block_hashes and all(len(h) == 32 for h in event.block_hashes)


@pytest.mark.parametrize("enable_caching", [True, False])
def test_off_records_nothing(enable_caching):
    manager = KVCacheManager(num_blocks=4, block_size=4, max_model_len=16, enable_caching=enable_caching)
    assert manager.block_pool.kv_events is None
    a, b = create_requests(2, num_tokens=16, block_size=4)
    prefill(manager, a)
    manager.free(a)
    prefill(manager, b)
    manager.free(b)
    manager.reset_prefix_cache()
    assert manager.take_events() == []
