"""InputProcessor: every check that rejects a request before the engine sees it, with the OpenAI error's param
and code, and what it fills in (max_tokens, the model's extra EOS ids)."""

from __future__ import annotations

import pytest

from pagedllm.engine.input_processor import InputProcessor, InvalidRequestError
from pagedllm.messages import ModelLimits
from pagedllm.sampling_params import SamplingParams

LIMITS = ModelLimits(vocab_size=100, max_model_len=32, eos_token_id=2, extra_stop_token_ids=[7],
                     generation_defaults={"temperature": 0.6, "max_new_tokens": 9, "unknown": 1})


@pytest.fixture
def processor() -> InputProcessor:
    return InputProcessor(LIMITS)


@pytest.mark.parametrize("prompt, params, kwargs, param, code", [
    ([], SamplingParams(), {}, "prompt", None),
    ([5, 100], SamplingParams(), {}, "prompt", None),  # out of vocabulary
    ([1] * 32, SamplingParams(), {}, "prompt", "context_length_exceeded"),
    ([1] * 30, SamplingParams(max_tokens=3), {}, "max_tokens", "context_length_exceeded"),
    ([1], SamplingParams(max_tokens=2, min_tokens=3), {}, "min_tokens", None),
    ([1], SamplingParams(temperature=-1.0), {}, "temperature", None),
    ([1], SamplingParams(), {"cache_salt": ""}, "cache_salt", None),
    ([1], SamplingParams(), {"cache_salt": "x" * 257}, "cache_salt", None),
    ([1], SamplingParams(), {"cache_salt": "\ud83d"}, "cache_salt", None),
    ([1], SamplingParams(stop=["\ud83d"]), {}, "stop", None),
    ([1], SamplingParams(), {"priority": 2**63}, "priority", None),
])
def test_rejects_with_param_and_code(processor, prompt, params, kwargs, param, code):
    with pytest.raises(InvalidRequestError) as info:
        processor.process("r", prompt, params, **kwargs)
    assert (info.value.param, info.value.code) == (param, code), str(info.value)


def test_fills_max_tokens_and_the_models_extra_eos(processor):
    request = processor.process("r", [1] * 30, SamplingParams(max_tokens=None), arrival_time=5.0, cache_salt="s")
    assert request.sampling_params.max_tokens == 2  # the room left in max_model_len
    assert request.sampling_params.stop_token_ids == [7] and request.eos_token_id == 2
    assert (request.arrival_time, request.cache_salt) == (5.0, "s")
    ignoring = processor.process("r", [1], SamplingParams(ignore_eos=True))
    assert ignoring.sampling_params.stop_token_ids == []  # ignore_eos keeps the extra EOS ids out too


def test_generation_config_defaults(processor):
    assert processor.sampling_defaults() == {"temperature": 0.6, "max_tokens": 9}
    params = processor.default_sampling_params()
    assert (params.temperature, params.max_tokens) == (0.6, 9)


def test_child_params_validate_the_parent_first(processor):
    with pytest.raises(InvalidRequestError) as info:
        processor.child_params(SamplingParams(n=2, top_p=0.0))
    assert info.value.param == "top_p"
    children = processor.child_params(SamplingParams(n=2, seed=None, prompt_logprobs=2))
    assert [(c.n, c.seed, c.prompt_logprobs) for c in children] == [(1, None, 2), (1, None, None)]
