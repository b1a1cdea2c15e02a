"""The offline LLM's sleep mode (vLLM's LLM.sleep / wake_up / reset_prefix_cache): the weights and the KV pool are
dropped and come back, and greedy output is the same after as before."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = "The quick brown fox jumps over the lazy dog. Paged attention stores the KV cache"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
               enable_sleep_mode=True)


def _greedy(llm: LLM) -> list[int]:
    return list(llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def test_sleep_drops_weights_and_pool_and_wake_up_restores_greedy_output(llm):
    before = _greedy(llm)
    worker = llm.llm_engine.engine_core.executor.driver_worker
    llm.sleep(2)  # (level 1: the last test)
    assert llm.is_sleeping() and worker.model_runner is None  # weights and pool gone, with their runner
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
    assert llm.wake_up(["weights"]) is False  # the pool still sleeps: not fully awake
    assert worker.model_runner is not None and not worker.model_runner.kv_caches
    assert llm.wake_up(["kv_cache"]) is True and not llm.is_sleeping()
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == before
    assert out.num_cached_tokens == 0  # the prefix cache was forgotten with the pool


def test_level_0_pauses_only_and_unknown_tags_are_refused(llm):
    runner = llm.llm_engine.engine_core.executor.driver_worker.model_runner
    llm.sleep(0)
    assert llm.is_sleeping()
    with pytest.raises(ValueError, match="unknown wake_up tag"):
        llm.wake_up(["everything"])
    assert llm.wake_up(["scheduling"]) is True
    assert llm.llm_engine.engine_core.executor.driver_worker.model_runner is runner  # nothing was dropped


def test_sleep_needs_enable_sleep_mode(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64, num_gpu_blocks_override=8)
    with pytest.raises(ValueError, match="--enable-sleep-mode"):
        llm.sleep(1)
    assert not llm.is_sleeping()


def test_reset_prefix_cache(llm):
    _greedy(llm)
    assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_sleep_after_a_partial_wake_up_drops_the_weights_again(llm):
    worker = llm.llm_engine.engine_core.executor.driver_worker
    before = _greedy(llm)
    llm.sleep(1)
    assert llm.wake_up(["weights"]) is False and worker.model_runner is not None
    llm.sleep(1)
    assert worker.model_runner is None
    assert llm.wake_up() is True and worker.model_runner.kv_caches
    assert _greedy(llm) == before
