"""The request checks that run before a request reaches the engine, without a server: the caps' defaults come
from the serve flags, precheck_caps rejects over-cap lists from the raw JSON, and booleans are not numbers."""

from __future__ import annotations

import json
from unittest import mock

import pytest
from pydantic import ValidationError

from pagedllm.config import ServerConfig
from pagedllm.entrypoints.openai.chat_protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.formatting import json_logprob
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.request_caps import precheck_caps
from pagedllm.entrypoints.openai.tokenize_protocol import DetokenizeRequest

CAPS = ServerConfig()


def _rejects(body: dict | bytes, param: str) -> str:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(APIError) as info:
        precheck_caps(raw, CAPS)
    assert info.value.status == 400 and info.value.param == param, (info.value.param, info.value.message)
    return info.value.message


@pytest.mark.parametrize("param,value", [
    ("prompt", ["hi"] * 1025), ("prompt", [[1, 2]] * 1025), ("prompt", [{"x": 1}] * 1025),
    ("stop", ["s"] * 65), ("stop_token_ids", [1] * 65), ("logit_bias", {str(i): 1 for i in range(1025)}),
    ("n", 129), ("n", 0), ("n", -5),
])
def test_precheck_rejects_over_cap(param, value):
    message = _rejects({"prompt": "x", param: value}, param)
    assert str(value if param == "n" else len(value)) in message


@pytest.mark.parametrize("body", [
    {"prompt": ["hi"] * 1024, "stop": ["s"] * 64, "stop_token_ids": [1] * 64, "n": 128},
    {"prompt": list(range(5000))},  # token ids: one prompt, however long (the context length decides)
    {"prompt": "a,b," * 5000, "stop": "x,y"},  # commas inside strings are not items
    {"prompt": "x", "logit_bias": {"1": 1, "2": 2}, "n": "2"},  # n as a string: the model's validation decides
    {"prompt": "x", "n": True}, {"prompt": "x", "n": 10**40},
])
def test_precheck_passes_what_is_not_over_a_cap(body):
    assert precheck_caps(json.dumps(body).encode(), CAPS) is None


def test_precheck_of_bodies_msgspec_refuses():
    assert precheck_caps(b"{not json", CAPS) is None
    assert precheck_caps(b"", CAPS) is None
    assert precheck_caps(b"[1, 2]", CAPS) == [1, 2]  # not an object: no cap applies; parsed once
    # NaN and lone surrogates are Python JSON that msgspec refuses: parsed once, returned for the request to use
    parsed = precheck_caps(b'{"prompt": "\\ud83d", "temperature": NaN}', CAPS)
    assert parsed["prompt"] == "\ud83d"
    _rejects(b'{"prompt": ["\\ud83d"' + b', "a"' * 1024 + b"]}", "prompt")
    _rejects(b'{"prompt": "x", "temperature": NaN, "n": 1000}', "n")


def test_precheck_counts_100k_prompts_without_building_them():
    """The list is counted as raw items (msgspec.Raw), never decoded into Python objects: json.loads, which
    would build them, is not called. (How fast that is: benchmarks/reliability_timings.py.)"""
    raw = json.dumps({"prompt": [[1, 2]] * 100_000}).encode()
    with mock.patch("json.loads", side_effect=AssertionError("the body was parsed into objects")):
        with pytest.raises(APIError) as info:
            precheck_caps(raw, CAPS)
    assert info.value.param == "prompt" and "100000" in info.value.message


@pytest.mark.parametrize("model,field,value", [
    (CompletionRequest, "top_k", True), (CompletionRequest, "n", False), (CompletionRequest, "max_tokens", True),
    (CompletionRequest, "logprobs", True), (CompletionRequest, "seed", True), (CompletionRequest, "temperature", True),
    (CompletionRequest, "stop_token_ids", [True]), (CompletionRequest, "logit_bias", {"1": True}),
    (ChatCompletionRequest, "max_completion_tokens", True), (ChatCompletionRequest, "top_logprobs", True),
    (ChatCompletionRequest, "min_tokens", True), (ChatCompletionRequest, "priority", False),
])
def test_booleans_are_not_numbers(model, field, value):
    base = {"prompt": "x"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(ValidationError) as info:
        model.model_validate_json(json.dumps({**base, field: value}))
    assert info.value.errors()[0]["loc"][0] == field
    assert "boolean" in info.value.errors()[0]["msg"]
    with pytest.raises(ValidationError):
        DetokenizeRequest.model_validate({"tokens": [1, True]})


def test_valid_numbers_stay_as_lax_as_vllm():
    request = CompletionRequest.model_validate_json('{"prompt": "x", "max_tokens": "3", "n": 2.0, "top_k": 5}')
    assert (request.max_tokens, request.n, request.top_k) == (3, 2, 5)
    assert CompletionRequest.model_validate({"prompt": "x", "n": None}).n == 1
    chat = ChatCompletionRequest.model_validate({"messages": [], "logprobs": True, "top_logprobs": 3})
    assert chat.logprobs is True and chat.top_logprobs == 3


def test_json_logprob():
    assert json_logprob(-1.5) == -1.5
    assert json_logprob(float("-inf")) == json_logprob(float("nan")) == json_logprob(-1e9) == -9999.0
    assert json_logprob(1e-7) == 0.0
