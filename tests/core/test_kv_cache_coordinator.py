"""The hybrid KV cache manager without a model: layouts, sliding groups freeing blocks outside their window, null
slots, prefix hits that satisfy every group, admission over every group's blocks, KV events reported once, and the
one-group layout left to the plain manager."""

from __future__ import annotations

import pytest

from pagedllm.core.kv_cache_coordinator import HybridKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_spec import make_kv_cache_layout, single_group_layout
from pagedllm.core.kv_events import BlockRemoved, BlockStored
from pagedllm.core.scheduler import Scheduler
from pagedllm.math_utils import cdiv

from .utils import create_requests, create_scheduler

BS = 4
W = 8
LAYOUT = make_kv_cache_layout([W, W, 0, W, W, 0])  # group_size 2: sliding (0, 1), sliding (3, 4), full (2, 5)
NULL = 0


def manager(num_blocks: int = 64, **kwargs) -> HybridKVCacheManager:
    kwargs.setdefault("max_model_len", 128)
    kwargs.setdefault("max_step_tokens", 16)
    return HybridKVCacheManager(LAYOUT, num_blocks, BS, **kwargs)


def tables(m: HybridKVCacheManager, req_id: str) -> list[list[int]]:
    """The request's block table per group."""
    ids = m.get_block_ids(req_id)
    n = len(ids) // len(m.groups)
    return [ids[g * n:(g + 1) * n] for g in range(len(m.groups))]


def prefill(m: HybridKVCacheManager, request) -> int:
    """Look up, allocate the rest of the prompt, mark it computed and cached; returns the hit's token count."""
    hits, num_hit = m.get_computed_blocks(request)
    assert m.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits) is not None
    request.num_computed_tokens = request.num_tokens
    m.cache_blocks(request, request.num_computed_tokens)
    return num_hit


def decode(m: HybridKVCacheManager, request, token: int) -> None:
    """One decode step: a slot for the last sampled token, then it is computed and the next token appended."""
    assert m.allocate_slots(request, 1) is not None
    request.num_computed_tokens += 1
    m.cache_blocks(request, request.num_computed_tokens)
    request.append_output_token_ids(token)


def test_layouts_group_layers_by_window_as_vllm_does():
    gemma3 = make_kv_cache_layout([512 if (i + 1) % 6 else 0 for i in range(18)])  # Gemma 3 270M: 5 sliding : 1
    assert gemma3.group_size == 3 and gemma3.is_hybrid
    assert [g.window for g in gemma3.groups] == [512] * 5 + [0]
    assert gemma3.groups[-1].layers == (5, 11, 17) and gemma3.groups[0].layers == (0, 1, 2)
    assert (gemma3.layer_group(11), gemma3.layer_tensor(11)) == (5, 1)
    assert gemma3.groups[1].layers == (3, 4, 6)  # the sliding layers in order, three at a time
    assert (gemma3.layer_group(7), gemma3.layer_tensor(7)) == (2, 0)
    assert [g.layers for g in LAYOUT.groups] == [(0, 1), (3, 4), (2, 5)]
    mistral = make_kv_cache_layout([W] * 4)  # every layer sliding: one group, still the hybrid manager's
    assert mistral.num_groups == 1 and mistral.group_size == 4 and mistral.is_hybrid
    plain = single_group_layout(4)
    assert plain.num_groups == 1 and not plain.is_hybrid and plain.groups[0].layers == (0, 1, 2, 3)
    with pytest.raises(ValueError):
        make_kv_cache_layout([])


def test_sliding_groups_hold_their_window_and_null_the_rest_during_decode():
    m = manager()
    (request,) = create_requests(1, num_tokens=10, block_size=BS, max_tokens=None)
    prefill(m, request)
    bound = cdiv(W - 1 + 1, BS) + 1  # the window before a one-token step, the step, one block of misalignment
    for step in range(60):
        decode(m, request, 1000 + step)
        n = request.num_computed_tokens
        held = m.num_blocks_held(request.request_id)
        assert held[2] == cdiv(n, BS)  # the full group keeps every block
        assert held[0] == held[1] <= bound
        freed = max(n - 1 - W + 1, 0) // BS  # freed at this step's allocation, when n - 1 tokens were computed
        for g, table in enumerate(tables(m, request.request_id)):
            assert len(table) == cdiv(n, BS)
            nulls = 0 if g == 2 else freed
            assert table[:nulls] == [NULL] * nulls and NULL not in table[nulls:]
    pool = m.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks - sum(m.num_blocks_held(request.request_id))
    m.free(request)
    assert pool.get_num_free_blocks() == pool.num_usable_blocks == 63
    assert pool.null_block.ref_cnt == 1 and pool.null_block not in pool.free_block_queue.get_all_free_blocks()


def test_repeated_prompt_hits_all_but_its_last_block_in_every_group():
    m = manager()
    prompt = list(range(100, 150))  # 50 tokens: 12 full blocks
    a, b = create_requests(2, prompt_token_ids=prompt, block_size=BS, max_tokens=None)
    assert prefill(m, a) == 0
    for step in range(9):
        decode(m, a, 7 + step)
    m.free(a)  # a's early sliding blocks were freed long ago; freed blocks keep their hashes
    num_hit = prefill(m, b)
    assert num_hit == (len(prompt) - 1) // BS * BS == 48 >= len(prompt) - BS
    slide0, slide1, full = tables(m, b.request_id)
    assert NULL not in full
    for table in (slide0, slide1):  # the hit needs only the blocks of the W - 1 keys before token 48
        assert NULL not in table[-3:] and table[:(48 - W + 1) // BS] == [NULL] * ((48 - W + 1) // BS)
    assert m.prefix_cache_hits == 48 and m.prefix_cache_queries == 100


def test_hit_stops_where_any_group_misses_and_the_groups_agree():
    m = manager()
    pool = m.block_pool
    prompt = list(range(200, 241))  # 41 tokens: a hit of at most 10 blocks
    a, b, c = create_requests(3, prompt_token_ids=prompt, block_size=BS, max_tokens=None)
    prefill(m, a)
    m.free(a)
    pool._evict(pool.cached_block_hash_to_block[a.block_hashes[6] + bytes((2,))])  # the full group loses block 6
    assert prefill(m, b) == 24
    for table in tables(m, b.request_id)[:2]:  # the sliding hits end where the full one does: 2 real blocks
        assert table[:4] == [NULL] * 4 and NULL not in table[4:]
    m.free(b)
    pool._evict(pool.cached_block_hash_to_block[a.block_hashes[8] + bytes((1,))])  # sliding group 1 loses block 8
    # Group 1 needs blocks 6 and 7 before a hit ending at block 8; group 0, found first with 10 blocks, is asked
    # again with that cap, and every group agrees on 8 blocks.
    assert prefill(m, c) == 32
    assert [len(t) for t in tables(m, c.request_id)] == [11, 11, 11]
    for table in tables(m, c.request_id)[:2]:
        assert table[:6] == [NULL] * 6 and NULL not in table[6:]


def test_allocation_counts_every_group_and_changes_nothing_when_it_fails():
    m = manager(num_blocks=13, max_model_len=16, max_step_tokens=4)  # one request: 4 full + 2 x 4 sliding = 12
    assert m.block_pool.num_usable_blocks == 12
    (request,) = create_requests(1, num_tokens=12, block_size=BS, max_tokens=None)
    assert m.allocate_slots(request, 12) is not None
    assert m.num_blocks_held(request.request_id) == [3, 3, 3]
    (other,) = create_requests(1, num_tokens=8, block_size=BS, max_tokens=None, id_prefix="x")
    assert m.allocate_slots(other, 8) is None  # 2 blocks x 3 groups = 6 > 3 free
    assert m.block_pool.get_num_free_blocks() == 3 and m.get_block_ids(other.request_id) == []
    assert m.allocate_slots(other, 4) is not None  # 1 x 3 fits exactly
    assert m.block_pool.get_num_free_blocks() == 0


def test_pool_too_small_for_one_request_is_refused_naming_the_groups():
    with pytest.raises(ValueError, match="3 KV cache groups"):
        manager(num_blocks=12, max_model_len=16, max_step_tokens=4)  # 11 usable < 12


def test_kv_events_report_each_block_once_from_the_full_group():
    m = manager(num_blocks=16, enable_kv_cache_events=True, max_model_len=20, max_step_tokens=4)
    ext = m.block_pool.kv_events.external_hash
    (request,) = create_requests(1, num_tokens=17, block_size=BS, max_tokens=None)
    prefill(m, request)  # 5 blocks in each of 3 groups, 4 of them full: 12 cached under 4 hashes
    events = m.take_events()
    assert [type(e) for e in events] == [BlockStored]
    assert events[0].block_hashes == [ext(h) for h in request.block_hashes]
    m.free(request)
    (big,) = create_requests(1, num_tokens=20, block_size=BS, max_tokens=None, id_prefix="big")
    assert m.allocate_slots(big, 20) is not None  # 15 blocks: every cached block is evicted
    removed = [h for e in m.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(ext(h) for h in request.block_hashes)


def test_one_full_attention_group_keeps_the_plain_manager_and_every_block():
    scheduler = create_scheduler(num_blocks=8, block_size=BS, max_model_len=32)
    assert type(scheduler.kv_cache_manager) is KVCacheManager
    plain = Scheduler(scheduler.scheduler_config, scheduler.cache_config, 8, 32,
                      kv_cache_layout=single_group_layout(4))
    assert type(plain.kv_cache_manager) is KVCacheManager and plain.num_total_blocks == 8
    hybrid = Scheduler(scheduler.scheduler_config, scheduler.cache_config, 64, 32, kv_cache_layout=LAYOUT)
    assert type(hybrid.kv_cache_manager) is HybridKVCacheManager and hybrid.num_total_blocks == 63


def test_cache_salts_keep_prefixes_apart_in_every_group():
    m = manager(num_blocks=128)  # room for b without evicting a's blocks
    prompt = list(range(300, 341))
    (a,) = create_requests(1, prompt_token_ids=prompt, block_size=BS, max_tokens=None, cache_salt="tenant-a")
    (b,) = create_requests(1, prompt_token_ids=prompt, block_size=BS, max_tokens=None, cache_salt="tenant-b",
                           id_prefix="b")
    (c,) = create_requests(1, prompt_token_ids=prompt, block_size=BS, max_tokens=None, cache_salt="tenant-a",
                           id_prefix="c")
    prefill(m, a)
    m.free(a)
    assert prefill(m, b) == 0  # the other tenant's blocks are not its prefix, in no group
    assert prefill(m, c) == 40  # its own tenant's are, in every group
