"""--kv-cache-dtype end to end on the tiny model: the pool's capacity, DESIGN invariant 2 within a KV dtype, and
start-up refusals."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from pagedllm import LLM, SamplingParams

GREEDY_12 = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _llm(model_dir, **kwargs):
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("max_model_len", 256)
    return LLM(str(model_dir), **kwargs)


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_capacity_grows_2x_for_bf16_and_4x_for_fp8(tiny_llama_dir, caplog):
    caplog.set_level(logging.INFO, logger="pagedllm.engine.core")
    blocks, pools = {}, {}
    for name in ("auto", "bfloat16", "fp8", "fp8_e5m2"):
        engine = _llm(tiny_llama_dir, kv_cache_memory=3 << 20, kv_cache_dtype=name).llm_engine.engine_core
        blocks[name] = engine.num_blocks
        pools[name] = engine.runner.kv_caches[0]
        assert engine.cache_config_info()["num_gpu_blocks"] == str(engine.num_blocks)
        assert engine.cache_config_info()["cache_dtype"] == name
        engine.shutdown()
    assert blocks["bfloat16"] == 2 * blocks["auto"] and blocks["fp8"] == blocks["fp8_e5m2"] == 4 * blocks["auto"]
    assert [pools[n].dtype for n in pools] == [torch.float32, torch.bfloat16, torch.float8_e4m3fn,
                                               torch.float8_e5m2]
    assert len({pool.nbytes for pool in pools.values()}) == 1  # the same memory each time
    tokens = 16 * blocks["fp8"]
    assert any(f"= {tokens} tokens" in r.getMessage() and "float8_e4m3fn" in r.getMessage() for r in caplog.records)


def _mixed_prompts(vocab: int) -> list[list[int]]:
    """16 prompts of 5-100 tokens; half share a 48-token prefix so the prefix cache has work to do."""
    rng = random.Random(2)
    shared = [rng.randrange(vocab) for _ in range(48)]
    return [(shared if i % 2 else []) + [rng.randrange(vocab) for _ in range(rng.randrange(5, 52))]
            for i in range(16)]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8"])
def test_batching_never_changes_greedy_output_within_an_fp8_cache(tiny_llama_dir, kv_cache_dtype):
    """DESIGN invariant 2 with an fp8 pool: alone, batched, prefix caching on/off, chunked, preempted: identical."""
    fp8 = _llm(tiny_llama_dir, num_gpu_blocks_override=256, kv_cache_dtype=kv_cache_dtype)
    prompts = _mixed_prompts(fp8.llm_engine.engine_core.vocab_size)
    alone = [_tokens(fp8.generate([p], GREEDY_12, use_tqdm=False))[0] for p in prompts]
    assert _tokens(fp8.generate(prompts, GREEDY_12, use_tqdm=False)) == alone
    no_prefix = _llm(tiny_llama_dir, num_gpu_blocks_override=256, kv_cache_dtype=kv_cache_dtype,
                     enable_prefix_caching=False)
    assert _tokens(no_prefix.generate(prompts, GREEDY_12, use_tqdm=False)) == alone
    chunked = _llm(tiny_llama_dir, num_gpu_blocks_override=256, kv_cache_dtype=kv_cache_dtype,
                   max_num_batched_tokens=32)
    assert _tokens(chunked.generate(prompts, GREEDY_12, use_tqdm=False)) == alone
    # 20 blocks of 16 tokens: 16 requests of up to ~110 tokens cannot all run at once.
    small = _llm(tiny_llama_dir, num_gpu_blocks_override=20, kv_cache_dtype=kv_cache_dtype,
                 max_num_batched_tokens=64)
    assert _tokens(small.generate(prompts, GREEDY_12, use_tqdm=False)) == alone
    assert small.llm_engine.num_preemptions > 0


def test_unknown_kv_cache_dtype_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        _llm(tiny_llama_dir, kv_cache_dtype="fp8_inc")
