"""In fp32 on the CPU, a prompt's logits do not depend on how it was prefilled: one chunk, several chunks, or after
a prefix cache hit give bitwise equal logprobs (every prefill row attends as a decode row of its position:
layers/attention.py)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

PROMPT = [(7 * i + 3) % 200 + 10 for i in range(203)]  # 12 full blocks of 16 and 11 tokens
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=20)


def _logprobs(llm):
    (out,) = llm.generate([PROMPT], PARAMS, use_tqdm=False)
    return [{t: lp.logprob for t, lp in step.items()} for step in out.outputs[0].logprobs]


@pytest.mark.slow
def test_chunks_and_cached_prefixes_give_bitwise_equal_logits(tiny_llama_dir):
    common = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    one_chunk = _logprobs(LLM(str(tiny_llama_dir), enable_prefix_caching=False, **common))
    chunked = LLM(str(tiny_llama_dir), max_num_batched_tokens=40, **common)  # 6 chunks
    assert _logprobs(chunked) == one_chunk
    hits = chunked.llm_engine.engine_core.scheduler.kv_cache_manager.prefix_cache_hits
    assert _logprobs(chunked) == one_chunk  # 192 tokens from the prefix cache, the last 11 computed
    assert chunked.llm_engine.engine_core.scheduler.kv_cache_manager.prefix_cache_hits - hits == 192
