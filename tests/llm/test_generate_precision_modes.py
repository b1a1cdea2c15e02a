"""Precision modes end to end on the tiny model (--kv-cache-dtype, quantized GGUF weights, int8 activations, fp8
weights): the KV pool's capacity, DESIGN invariant 2 within each mode, and start-up refusals."""

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


COMBINATIONS = {  # name: (model fixture, engine options of the feature under test)
    "fp8-kv": ("tiny_llama_dir", {"kv_cache_dtype": "fp8"}),
    "fp8-kv-scale-one": ("tiny_llama_dir", {"kv_cache_dtype": "fp8", "calculate_kv_scales": False}),
    "gguf-quantized": ("tiny_llama_gguf_quantized", {}),
    "gguf-int8-activations": ("tiny_llama_gguf_quantized", {"activation_quantization": "int8"}),
    "gguf-int8-activations-fp8-kv": ("tiny_llama_gguf_quantized",
                                     {"activation_quantization": "int8", "kv_cache_dtype": "fp8"}),
    "fp8-weights": ("tiny_llama_dir", {"quantization": "fp8"}),
}


@pytest.mark.slow  # tens of seconds: out of the fast run (-m "not slow"), still in CI
@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_batching_never_changes_greedy_output_within_a_precision_mode(request, name):
    """DESIGN invariant 2 within each precision mode (quantized weights, int8 activations, fp8 weights, fp8 KV):
    alone, batched, prefix caching off, chunked, preempted and n=2 all give the same tokens."""
    fixture, options = COMBINATIONS[name]
    model = request.getfixturevalue(fixture)
    base = _llm(model, num_gpu_blocks_override=256, **options)
    prompts = _mixed_prompts(base.llm_engine.engine_core.vocab_size)
    alone = [_tokens(base.generate([p], GREEDY_12, use_tqdm=False))[0] for p in prompts]
    assert _tokens(base.generate(prompts, GREEDY_12, use_tqdm=False)) == alone
    two = base.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2),
                        use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in two] == [[a, a] for a in alone[:4]]
    no_prefix = _llm(model, num_gpu_blocks_override=256, enable_prefix_caching=False, **options)
    assert _tokens(no_prefix.generate(prompts, GREEDY_12, use_tqdm=False)) == alone
    chunked = _llm(model, num_gpu_blocks_override=256, max_num_batched_tokens=32, **options)
    assert _tokens(chunked.generate(prompts, GREEDY_12, use_tqdm=False)) == alone
    # 20 blocks of 16 tokens: 16 requests of up to ~110 tokens cannot all run at once.
    small = _llm(model, num_gpu_blocks_override=20, max_num_batched_tokens=64, **options)
    assert _tokens(small.generate(prompts, GREEDY_12, use_tqdm=False)) == alone
    assert small.llm_engine.num_preemptions > 0


def test_unknown_kv_cache_dtype_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        _llm(tiny_llama_dir, kv_cache_dtype="fp8_inc")


def test_int8_activations_default_to_a_bf16_kv_cache(tiny_llama_gguf_quantized, tiny_llama_dir):
    """--activation-quantization int8 resolves --kv-cache-dtype auto to bfloat16 (the fast mode's default, measured
    in benchmarks/RESULTS.md); an explicit dtype, float32 included, is kept; without the fast mode auto is the
    model dtype; a float32 cache under a bf16 model is refused."""
    pools = {}
    for name, options in {"fast": {"activation_quantization": "int8"},
                          "fast-fp32-kv": {"activation_quantization": "int8", "kv_cache_dtype": "float32"},
                          "lossless": {}}.items():
        engine = _llm(tiny_llama_gguf_quantized, kv_cache_memory=3 << 20, **options).llm_engine.engine_core
        pools[name] = (engine.runner.kv_caches[0].dtype, engine.cache_config_info()["cache_dtype"])
        engine.shutdown()
    assert pools == {"fast": (torch.bfloat16, "bfloat16"), "fast-fp32-kv": (torch.float32, "float32"),
                     "lossless": (torch.float32, "auto")}
    with pytest.raises(ValueError, match="float32 needs a float32 model"):
        _llm(tiny_llama_dir, dtype="bfloat16", kv_cache_dtype="float32")


def test_int8_activations_with_a_bf16_kv_cache_under_speculation_and_cache_salts(tiny_llama_gguf_quantized):
    """The fast mode with its bf16 cache beside n-gram speculation and cache salts: the same greedy tokens as the
    fast mode alone for every salt, drafts proposed and accepted, every block free at the end."""
    fast = _llm(tiny_llama_gguf_quantized, num_gpu_blocks_override=256, activation_quantization="int8")
    spec = _llm(tiny_llama_gguf_quantized, num_gpu_blocks_override=256, activation_quantization="int8",
                speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    rng = random.Random(7)
    vocab = fast.llm_engine.engine_core.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(3, 7))] * rng.randrange(3, 8) for _ in range(8)]
    assert spec.llm_engine.engine_core.runner.kv_caches[0].dtype == torch.bfloat16
    expected = [_tokens(fast.generate([p], GREEDY_12, use_tqdm=False))[0] for p in prompts]
    salted = [{"prompt_token_ids": p, "cache_salt": salt} for p in prompts for salt in ("a", "b")]
    assert _tokens(spec.generate(salted, GREEDY_12, use_tqdm=False)) == [t for t in expected for _ in range(2)]
    totals = spec.llm_engine.engine_core.scheduler.spec_decoding_totals
    assert totals.num_drafts > 0 and totals.num_accepted_tokens > 0
    scheduler = spec.llm_engine.engine_core.scheduler
    assert scheduler.num_free_blocks == scheduler.num_total_blocks
