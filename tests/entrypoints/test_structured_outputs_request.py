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
     StructuredOutputsParams(json=SCHEMA, disable_additional_properties=True)),  # strict: objects closed
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": False}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"}, StructuredOutputsParams(json=SCHEMA,
                                                                                         whitespace_pattern=" ?")),
    ({"guided_regex": "a+"}, StructuredOutputsParams(regex="a+")),
    ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
    ({"guided_grammar": 'start: "a"'}, StructuredOutputsParams(grammar='start: "a"')),
    ({"guided_json_object": True}, StructuredOutputsParams(json_object=True)),
    ({"guided_regex": "a+", "guided_decoding_backend": "guidance"}, StructuredOutputsParams(regex="a+")),
    ({"structured_outputs": {"json": SCHEMA}, "guided_whitespace_pattern": " "},
     StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ")),
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


@pytest.mark.parametrize("fields, param", [
    ({"guided_regex": "a+", "structured_outputs": {"regex": "b+"}}, "guided_regex"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "structured_outputs"),
    ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_regex": "a+", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"guided_json": SCHEMA, "structural_tag": "{}"}, "structural_tag"),
])
def test_guided_fields_in_conflict_are_refused_naming_one(fields, param):
    with pytest.raises(APIError) as info:
        structured_outputs_of(_chat(**fields))
    assert info.value.status == 400 and info.value.param == param


def test_completions_take_response_format_and_guided_fields():
    request = CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "json_object"}})
    assert structured_outputs_of(request) == (StructuredOutputsParams(json_object=True), "response_format")
    request = CompletionRequest.model_validate({"prompt": "x", "guided_choice": ["a"]})
    assert structured_outputs_of(request) == (StructuredOutputsParams(choice=["a"]), "guided_choice")


def test_unknown_fields_are_ignored_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="pagedllm.entrypoints.openai.base_model"):
        request = _chat(guided_nope=SCHEMA, structured_outputs={"json": SCHEMA, "nope": 1})
    assert request.structured_outputs.json_ == SCHEMA
    messages = [r.getMessage() for r in caplog.records]
    assert "The following fields were present in the request but ignored: ['guided_nope']" in messages
    assert "The following fields were present in the request but ignored: ['nope']" in messages
