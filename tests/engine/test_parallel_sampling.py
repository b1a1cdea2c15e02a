"""fan_out: how both frontends turn a request with n > 1 into n validated, registered child requests."""

from __future__ import annotations

import pytest

from pagedllm.engine.input_processor import InputProcessor, InvalidRequestError
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.parallel_sampling import fan_out
from pagedllm.messages import ModelLimits
from pagedllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def processors(tiny_tokenizer):
    return InputProcessor(ModelLimits(vocab_size=384, max_model_len=64, eos_token_id=2)), tiny_tokenizer


def test_n_children_seeded_and_only_the_first_sent(processors):
    inputs, tokenizer = processors
    outputs = OutputProcessor(tokenizer)
    params = SamplingParams(n=3, seed=5, max_tokens=4, prompt_logprobs=1)
    requests = fan_out(inputs, outputs, "r", [10, 11, 12], params, "abc", "delta", arrival_time=1.0)
    assert [r.request_id for r in requests] == ["0_r", "1_r", "2_r"]
    assert [r.sampling_params.seed for r in requests] == [5, 6, 7]
    assert [r.sampling_params.n for r in requests] == [1, 1, 1]
    assert [r.sampling_params.prompt_logprobs for r in requests] == [1, None, None]
    assert {r.arrival_time for r in requests} == {1.0}
    parent = outputs.request_states["0_r"].parent
    assert parent is not None and parent.pending == requests[1:]
    assert sorted(outputs.request_states) == ["0_r", "1_r", "2_r"]


def test_n_1_is_the_request_itself(processors):
    inputs, tokenizer = processors
    outputs = OutputProcessor(tokenizer)
    (request,) = fan_out(inputs, outputs, "r", [10, 11], SamplingParams(max_tokens=4), None, "cumulative")
    assert request.request_id == "r" and outputs.request_states["r"].parent is None


def test_an_invalid_request_registers_nothing(processors):
    inputs, tokenizer = processors
    outputs = OutputProcessor(tokenizer)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        fan_out(inputs, outputs, "r", [10] * 10, SamplingParams(n=2, max_tokens=60), None, "delta")
    assert outputs.request_states == {}
