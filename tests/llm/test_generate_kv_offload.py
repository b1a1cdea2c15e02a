"""The KV offload tier (OffloadingConnector) end to end on the tiny Llama with a pool too small to keep the
prompts: greedy outputs are token-identical with the tier on and off, prompts evicted from the pool are loaded
from the tier (fewer tokens computed, hits counted per tier), cache salts never share, a preempted request reuses
its offloaded blocks, chunked prefill / n > 1 / n-gram speculation / a disk tier with corrupted files all give
the same tokens, a full tier evicts LRU, two engines share one region, and no region is left in /dev/shm."""

from __future__ import annotations

import os
import random
import uuid

import pytest

from pagedllm import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
POOL = 12
"""Blocks in the pool (16 tokens each): two of the 64-token prompts fit in it at a time, not four."""
FULL = 4
"""Full blocks of a prompt."""
BLOCK_BYTES = 3 * 2 * 16 * 2 * 16 * 4
"""The tiny Llama's block over its 3 layers (K and V, 16 tokens, 2 KV heads of 16, fp32)."""


def _prompts(n: int = 4, length: int = 64, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300) for _ in range(length)] for _ in range(n)]


def _tokens(llm, prompts, params=GREEDY, salt=None):
    inputs = [{"prompt_token_ids": p, **({"cache_salt": salt} if salt else {})} for p in prompts]
    outputs = llm.generate(inputs, params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outputs], [o.num_cached_tokens for o in outputs]


def _offload(cpu_blocks: int = 64, **extra) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_blocks * BLOCK_BYTES,
                                          "shm_name": f"pagedllm-test-{uuid.uuid4().hex}", **extra}}


def _make(make_llm, model, **kwargs):
    kwargs.setdefault("num_gpu_blocks_override", POOL)
    kwargs.setdefault("max_model_len", 128)
    return make_llm(model, **kwargs)


def _region(llm) -> str:
    return llm.llm_engine.engine_core.kv_connector.spec.path


def _stats(llm) -> dict[str, float]:
    kv_transfer = llm.llm_engine.engine_core.scheduler.kv_transfer
    return {**kv_transfer.connector.get_stats(),
            "external_hits": kv_transfer.external_hits, "external_queries": kv_transfer.external_queries}


def _shutdown(llm) -> None:
    path = _region(llm)
    llm.llm_engine.engine_core.shutdown()
    assert not os.path.exists(path), "the region outlived the engine"


@pytest.fixture(scope="module")
def reference(make_llm, tiny_llama_dir):
    llm = _make(make_llm, tiny_llama_dir)
    prompts = _prompts()
    ref = _tokens(llm, prompts)[0]
    llm.llm_engine.engine_core.shutdown()
    return prompts, ref


def test_evicted_prefixes_load_from_the_tier_token_identical(make_llm, tiny_llama_dir, reference):
    prompts, ref = reference
    llm = _make(make_llm, tiny_llama_dir, kv_transfer_config=_offload())
    assert os.path.exists(_region(llm))
    first, cached = _tokens(llm, prompts)
    assert first == ref and _stats(llm)["external_hits"] == 0
    again, cached = _tokens(llm, prompts)  # the pool kept at most the last prompts: the rest come from the tier
    assert again == ref
    stats = _stats(llm)
    # Every full block but the prompt's last token's is a hit, local or from the tier (the last token is computed).
    assert stats["external_hits"] >= 2 * 63 and sum(cached) == 4 * 63
    hits = stats["vllm:kv_offload_tiering_block_hits|0:primary"]  # counted at admission, resumptions included
    assert hits >= 2 * FULL and stats["vllm:kv_offload_total_bytes|CPU_to_GPU"] == hits * BLOCK_BYTES
    assert stats["vllm:kv_offload_total_bytes|GPU_to_CPU"] == 4 * FULL * BLOCK_BYTES  # each block stored once
    salted, cached = _tokens(llm, prompts[:2], salt="tenant-b")  # another salt: no block shared
    assert salted == ref[:2] and cached == [0, 0]
    assert _stats(llm)["external_hits"] == stats["external_hits"]
    logprobs = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)  # every position computed
    assert _tokens(llm, prompts[:1], logprobs)[1] == [0]
    assert _stats(llm)["external_hits"] == stats["external_hits"]
    _shutdown(llm)


def test_preempted_request_reuses_its_offloaded_blocks(make_llm, tiny_llama_dir):
    """Three 2-block prompts fill 6 of 8 blocks; their first decode needs 9: one is preempted, and resumes from
    the tier (prefix caching off: the tier is the only place its blocks survive)."""
    prompts = _prompts(3, 32, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kwargs = {"num_gpu_blocks_override": 8, "enable_prefix_caching": False, "max_model_len": 64}
    base = make_llm(tiny_llama_dir, **kwargs)
    ref = _tokens(base, prompts, params)[0]
    base.llm_engine.engine_core.shutdown()
    llm = make_llm(tiny_llama_dir, kv_transfer_config=_offload(), **kwargs)
    assert _tokens(llm, prompts, params)[0] == ref
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert _stats(llm)["vllm:kv_offload_tiering_block_hits|0:primary"] > 0  # resumed from the tier
    _shutdown(llm)


def test_chunked_prefill_ngram_and_n2_token_identical(make_llm, tiny_llama_dir, reference):
    prompts, ref = reference
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = _make(make_llm, tiny_llama_dir, kv_transfer_config=_offload(),
                   max_num_batched_tokens=24, enable_chunked_prefill=True, speculative_config=ngram)
    for _ in range(2):
        assert _tokens(llm, prompts)[0] == ref
    assert _stats(llm)["external_hits"] > 0
    two = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, n=2)  # n > 1: both children the same
    assert _tokens(llm, prompts[:2], two)[0] == [[r[0], r[0]] for r in ref[:2]]
    _shutdown(llm)


def test_full_tier_evicts_lru_and_two_engines_share_it(make_llm, tiny_llama_dir, reference):
    """A tier of 6 blocks (one prompt's 4 and a bit), prompts one after the other: no error, the latest prompt
    is a hit, the first not; a second engine attached to the same region (same shm_name) gets the first engine's
    blocks. (A step that stores more new blocks than the tier has slots stores only as many: blocks being
    written are never evicted.)"""
    prompts, ref = reference
    config = _offload(cpu_blocks=6)
    llm = _make(make_llm, tiny_llama_dir, kv_transfer_config=config)
    for prompt, expected in zip(prompts[:3], ref[:3], strict=True):
        assert _tokens(llm, [prompt])[0] == [expected]
    store = llm.llm_engine.engine_core.kv_connector.scheduler.store
    assert store.num_blocks() == (6, 0)
    other = _make(make_llm, tiny_llama_dir, kv_transfer_config=config)
    assert _tokens(other, prompts[2:3])[0] == ref[2:3] and _stats(other)["external_hits"] == 63
    assert _tokens(other, prompts[:1])[0] == ref[:1] and _stats(other)["external_hits"] == 63  # evicted
    path = _region(llm)
    llm.llm_engine.engine_core.shutdown()
    assert os.path.exists(path)  # the other engine still uses it
    _shutdown(other)


def test_disk_tier_and_corrupted_files(make_llm, tiny_llama_dir, reference, tmp_path):
    """RAM holds 4 blocks, disk the rest: the first prompts come back from disk; with every disk file corrupted
    the loads fail, the blocks are recomputed, and the tokens stay the same."""
    prompts, ref = reference
    config = _offload(cpu_blocks=4, disk_path=str(tmp_path), disk_bytes_to_use=64 * (BLOCK_BYTES + 64))
    llm = _make(make_llm, tiny_llama_dir, kv_transfer_config=config)
    assert _tokens(llm, prompts)[0] == ref
    assert _tokens(llm, prompts[:2])[0] == ref[:2]
    stats = _stats(llm)
    assert stats["vllm:kv_offload_tiering_block_hits|1:disk"] >= FULL
    assert stats["vllm:kv_offload_tiering_read_bytes|1:disk"] >= FULL * BLOCK_BYTES
    disk_dir = llm.llm_engine.engine_core.kv_connector.spec.disk_dir
    for name in os.listdir(disk_dir):
        with open(os.path.join(disk_dir, name), "r+b") as f:
            f.seek(200)
            f.write(b"\xff" * 8)
    assert _tokens(llm, prompts[2:4])[0] == ref[2:4]
    assert _stats(llm).get("pagedllm:kv_offload_load_errors", 0) > 0
    _shutdown(llm)
    assert not os.path.exists(disk_dir)


def test_sleep_mode_rebinds_the_new_pool(make_llm, tiny_llama_dir, reference):
    """Sleep drops the pool, wake-up allocates another: the worker side copies into the new one (the prompts come
    back from the tier, token-identical)."""
    prompts, ref = reference
    llm = _make(make_llm, tiny_llama_dir, kv_transfer_config=_offload(), enable_sleep_mode=True)
    assert _tokens(llm, prompts[:2])[0] == ref[:2]
    llm.sleep(2)
    llm.wake_up()
    again, cached = _tokens(llm, prompts[:2])
    assert again == ref[:2] and cached == [63, 63] and _stats(llm)["external_hits"] == 2 * 63
    _shutdown(llm)


@pytest.mark.slow
def test_tensor_parallel_2_stores_each_ranks_heads(make_llm, tiny_llama_dir, reference):
    """TP=2 (mp executor, one process per rank): each rank stores its own KV head under (hash, rank) in the one
    region the scheduler looks up (a block counts only when both ranks have it); tokens as TP=1."""
    prompts, ref = reference
    llm = _make(make_llm, tiny_llama_dir, kv_transfer_config=_offload(), tensor_parallel_size=2)
    try:
        assert _tokens(llm, prompts)[0] == ref
        store = llm.llm_engine.engine_core.kv_connector.scheduler.store
        assert store.num_blocks()[0] == 2 * 4 * FULL  # every block, once per rank
        assert store.geometry.slot_bytes == BLOCK_BYTES // 2  # one of the two KV heads
        assert _tokens(llm, prompts)[0] == ref
        stats = _stats(llm)
        assert stats["external_hits"] >= 2 * 63
        assert stats["vllm:kv_offload_total_bytes|GPU_to_CPU"] == 4 * FULL * BLOCK_BYTES  # both ranks' halves
    finally:
        _shutdown(llm)
