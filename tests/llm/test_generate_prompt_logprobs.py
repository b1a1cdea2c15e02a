"""Offline prompt_logprobs: the same values with the prefix cache on or off, chunked or not, n = 1 or more;
with n > 1 only the first sibling computes them and the others take the prompt from the cache."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

PROMPT = list(range(100, 180))  # 80 tokens: 5 full blocks of 16


def _values(output) -> list:
    """Per position: token id -> (rank, text); the logprobs are compared to 1e-5 separately."""
    return [None if p is None else {t: (lp.rank, lp.decoded_token) for t, lp in p.items()}
            for p in output.prompt_logprobs]


def test_prompt_logprobs_do_not_depend_on_cache_chunks_or_n(tiny_llama_dir):
    common = dict(dtype="float32", max_model_len=512, num_gpu_blocks_override=256)
    plain = LLM(str(tiny_llama_dir), enable_prefix_caching=False, **common)
    (reference,) = plain.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2),
                                  use_tqdm=False)
    del plain
    cached = LLM(str(tiny_llama_dir), max_num_batched_tokens=32, **common)  # the 80-token prompt in 3 chunks
    cached.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # cache the prompt
    kv = cached.llm_engine.engine_core.scheduler.kv_cache_manager
    hits_before = kv.prefix_cache_hits
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    (out,) = cached.generate([PROMPT], params, use_tqdm=False)
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    assert _values(out) == _values(reference)
    for got, want in zip(out.prompt_logprobs[1:], reference.prompt_logprobs[1:], strict=True):
        assert [lp.logprob for lp in got.values()] == pytest.approx([lp.logprob for lp in want.values()], abs=1e-5)
    # child 0 skipped the cache (it needs every position's logits); children 1 and 2 took the 64 cached tokens
    assert kv.prefix_cache_hits - hits_before == 2 * 64  # before: 0 (all three computed the prompt)
