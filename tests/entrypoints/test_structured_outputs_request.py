"""The request fields of structured outputs as SamplingParams, without a server: response_format fills
structured_outputs as vLLM's does, and unknown fields are ignored with a warning naming them."""

from __future__ import annotations

import logging

import pytest

from pagedllm.entrypoints.openai.chat_protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.structured_outputs import structured_outputs_of
from pagedllm.sampling_params import StructuredOutputsParams

MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"disable_any_whitespace": True}},
     StructuredOutputsParams(json_object=True, disable_any_whitespace=True)),
    ({"structured_outputs": {"choice": ["a", "b"], "whitespace_pattern": " "}},
     StructuredOutputsParams(choice=["a", "b"], whitespace_pattern=" ")),
])
def test_request_fields_to_params(fields, expected):
    assert structured_outputs_of(_chat(**fields))[0] == expected


def test_completions_take_structured_outputs():
    request = CompletionRequest.model_validate({"prompt": "x", "structured_outputs": {"json": SCHEMA}})
    assert structured_outputs_of(request) == (StructuredOutputsParams(json=SCHEMA), "structured_outputs")


def test_both_fields_with_a_constraint_are_refused():
    with pytest.raises(APIError) as info:
        structured_outputs_of(_chat(response_format={"type": "json_object"}, structured_outputs={"json": SCHEMA}))
    assert info.value.status == 400 and info.value.param == "response_format"


def test_unknown_fields_are_ignored_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="pagedllm.entrypoints.openai.base_model"):
        request = _chat(guided_json=SCHEMA, structured_outputs={"json": SCHEMA, "nope": 1})
    assert request.structured_outputs.json_ == SCHEMA
    messages = [r.getMessage() for r in caplog.records]
    assert "The following fields were present in the request but ignored: ['guided_json']" in messages
    assert "The following fields were present in the request but ignored: ['nope']" in messages
