"""--scheduling-policy slo end to end (offline LLM, the tiny model): when nothing is shed, greedy outputs are the
same tokens as under fcfs, with prefix caching, chunked prefill, preemption, n > 1, cache salts, n-gram
speculative decoding and async scheduling; every block is free at the end."""

from __future__ import annotations

import msgspec
import pytest

from pagedllm import LLM, SamplingParams

SHARED = [(5 * i + 11) % 300 + 20 for i in range(40)]  # a common prefix: prefix-cache hits
PROMPTS = [{"prompt_token_ids": SHARED + [(j * 13 + k) % 300 + 20 for k in range(j + 3)]} for j in range(6)]
PROMPTS += [{"prompt_token_ids": SHARED[:33], "cache_salt": "tenant-a"},
            {"prompt_token_ids": SHARED[:33], "cache_salt": "tenant-b"},
            {"prompt_token_ids": [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]}]  # repeats itself: n-gram drafts
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2)
PRIORITIES = [3, 0, 2, 1, 0, 5, 1, 2, 0]


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def _with_slo(params: SamplingParams, i: int) -> SamplingParams:
    # deadlines loose enough that nothing is shed, yet different, so the slo order differs from arrival
    return msgspec.structs.replace(params, ttft_slo_ms=600_000.0 - 1000 * (i % 4), tpot_slo_ms=60_000.0)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    dict(max_num_batched_tokens=32, num_gpu_blocks_override=12),  # chunks of <= 32 tokens; 12 blocks: preemptions
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                             "prompt_lookup_max": 3}),
    dict(async_scheduling=True),  # steps in flight: the step-time fit is measured on the batch-queue path
], ids=["chunked-preempted", "ngram", "async"])
def test_slo_outputs_equal_fcfs_when_nothing_is_shed(tiny_llama_dir, extra):
    common = dict(dtype="float32", max_model_len=128, block_size=16, **extra)
    common.setdefault("num_gpu_blocks_override", 64)
    fcfs = _tokens(LLM(str(tiny_llama_dir), **common).generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = LLM(str(tiny_llama_dir), scheduling_policy="slo", **common)
    params = [_with_slo(GREEDY, i) for i in range(len(PROMPTS))]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False, priority=PRIORITIES)
    assert all(o.error is None for o in outputs)
    assert _tokens(outputs) == fcfs
    scheduler = llm.llm_engine.engine_core.scheduler
    assert scheduler.num_slo_shed == 0 and scheduler.kv_cache_manager.prefix_cache_hits > 0
    assert scheduler.waiting.tokens_per_s is not None  # the engine measured its steps: estimates and shedding work
    if "max_num_batched_tokens" in extra:
        assert scheduler.num_preemptions > 0
    elif "speculative_config" in extra:
        assert scheduler.spec_decoding_totals.num_draft_tokens > 0
    assert scheduler.num_free_blocks == scheduler.num_total_blocks and not scheduler.requests
