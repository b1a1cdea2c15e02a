"""POST /v1/responses and GET /v1/responses/{id} against one real `pagedllm serve` (the tiny random model, the
shipped hermes tool template, --max-stored-responses 3), driven by the unmodified `openai` SDK
(`responses.create`, `responses.stream`, `create(stream=True)`) and by raw HTTP for the errors. A response is the
chat completion of the same messages, token for token; and every declared field of ResponsesRequest is honoured,
refused with a 400 naming it, or documented to change nothing (`test_every_field_has_an_entry`)."""

from __future__ import annotations

import json

import openai
import pytest
from request_fields import declared_fields
from server_utils import MODEL_NAME, RemoteServer

from pagedllm.config import ServerConfig
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.serving_responses import _chat_request
from pagedllm.entrypoints.openai.tool_calling import ToolCalling

GREEDY = {"model": MODEL_NAME, "temperature": 0.0}
TOOL = {"type": "function", "name": "now", "description": "The time.",
        "parameters": {"type": "object", "properties": {"tz": {"enum": ["utc", "local"]}}, "required": ["tz"]}}
STORED = 3


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    server = RemoteServer(tiny_llama_dir, "--chat-template", "tool_chat_template_hermes.jinja",
                          "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                          "--max-stored-responses", str(STORED))
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat_text(client, messages, max_tokens=6, **extra) -> str:
    response = client.chat.completions.create(messages=messages, max_tokens=max_tokens, **GREEDY, extra_body=extra)
    return response.choices[0].message.content


def respond(client, max_output_tokens=6, **fields):
    extra = {k: fields.pop(k) for k in list(fields) if k not in _SDK_ARGS}
    return client.responses.create(max_output_tokens=max_output_tokens, **{**GREEDY, **fields}, extra_body=extra)


_SDK_ARGS = {"input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "stream", "store",
             "previous_response_id", "metadata", "user", "text", "reasoning", "top_p", "temperature", "model",
             "truncation", "service_tier", "safety_identifier", "prompt_cache_key", "include", "background",
             "max_tool_calls", "top_logprobs", "prompt", "conversation", "stream_options"}


def test_text_messages_and_instructions_are_the_chat_completion(client):
    hello = [{"role": "user", "content": "Hello world"}]
    response = respond(client, input="Hello world")
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL_NAME
    assert response.output_text == chat_text(client, hello) and response.output[0].type == "message"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 6 and response.usage.total_tokens == response.usage.input_tokens + 6
    turns = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"},
             {"role": "user", "content": [{"type": "input_text", "text": "How are you?"}]}]
    assert respond(client, input=turns, instructions="Be brief.").output_text == chat_text(
        client, [{"role": "system", "content": "Be brief."}, *turns[:2], {"role": "user", "content": "How are you?"}])


def test_sdk_stream_and_create_stream_send_openai_events(client):
    expected = respond(client, input="Hello world", max_output_tokens=8).output_text
    with client.responses.stream(input="Hello world", max_output_tokens=8, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == expected and final.output[0].id == events[2].item.id
    raw = list(client.responses.create(input="Hello world", max_output_tokens=8, stream=True, **GREEDY))
    assert [e.type for e in raw] == types and raw[-1].response.output_text == expected


def test_previous_response_id_store_and_eviction(server, client):
    first = respond(client, input="Hello")
    second = respond(client, input="Again", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert second.output_text == chat_text(client, [{"role": "user", "content": "Hello"},
                                                    {"role": "assistant", "content": first.output_text},
                                                    {"role": "user", "content": "Again"}])
    assert client.responses.retrieve(first.id).output_text == first.output_text  # GET /v1/responses/{id}
    unstored = respond(client, input="Hello", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    for _ in range(STORED):  # the least recently used is dropped beyond --max-stored-responses: 404 then
        respond(client, input="Hello", max_output_tokens=1)
    for call in (lambda: client.responses.retrieve(first.id),
                 lambda: respond(client, input="x", previous_response_id=first.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["param"] == "response_id" and first.id in e.value.body["message"]


def test_function_tools_calls_and_outputs(client):
    response = respond(client, input="What time is it?", tools=[TOOL], tool_choice="required", max_output_tokens=40)
    call = response.output[0]
    assert call.type == "function_call" and call.name == "now" and call.arguments.startswith("{")
    assert call.call_id and call.id.startswith("fc_")
    with client.responses.stream(input="What time is it?", tools=[TOOL], tool_choice="required",
                                 max_output_tokens=40, **GREEDY) as stream:
        types = [e.type for e in stream]
        streamed = stream.get_final_response().output[0]
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
    # the call's output, as the next turn's input: a tool message after the assistant's call
    answer = [{"type": "function_call", "call_id": call.call_id, "name": "now", "arguments": '{"tz": "utc"}'},
              {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}]
    follow = respond(client, input=[{"role": "user", "content": "What time is it?"}, *answer])
    assert follow.output_text == chat_text(client, [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": "now", "arguments": '{"tz": "utc"}'}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "12:00"}])
    named = respond(client, input="Time?", tools=[TOOL], tool_choice={"type": "function", "name": "now"},
                    max_output_tokens=40)
    assert named.output[0].name == "now"


# ---- every field --------------------------------------------------------------------------------------------


def post(server, **fields):
    return server.post("/v1/responses", json={"input": "Hello world", "max_output_tokens": 4, **GREEDY, **fields},
                       timeout=60.0)


def refused(param, **fields):
    def check(server, client):
        response = post(server, **fields)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param, response.text
    return check


def no_effect(**fields):
    def check(server, client):
        assert respond(client, input="Hello world", **fields).output_text == respond(client, input="Hello world"
                                                                                     ).output_text
    return check


def as_in_chat(changes=True, **fields):
    """The response is the chat completion with the same field (whose honouring the chat walk checks), and the
    field changes the output."""
    def check(server, client):
        text = respond(client, input="Hello world", max_output_tokens=12, **fields).output_text
        assert text == chat_text(client, [{"role": "user", "content": "Hello world"}], max_tokens=12, **fields)
        if changes:
            assert text != respond(client, input="Hello world", max_output_tokens=12).output_text
    return check


def schema_of(**fields):
    request = ResponsesRequest.model_validate({"input": "x", "tools": [TOOL], "tool_choice": "required", **fields})
    return ToolCalling(_chat_request(request, [{"role": "user", "content": "x"}]),
                       ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")).schema


def _model(server, client):
    assert post(server, model="nope").status_code == 404


def _max_output_tokens(server, client):
    assert respond(client, input="Hello", max_output_tokens=3, ignore_eos=True).usage.output_tokens == 3


def _metadata(server, client):
    assert respond(client, input="Hello", metadata={"k": "v"}).metadata == {"k": "v"}


def _store(server, client):
    assert post(server, store=False).json()["store"] is False


def _json_object(server, client):
    text = respond(client, input="Hi", text={"format": {"type": "json_object"}}, max_output_tokens=8).output_text
    assert text.lstrip().startswith("{")


def _json_schema(server, client):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    text = respond(client, input="Hi", max_output_tokens=12, text={"format": {
        "type": "json_schema", "name": "x", "description": "d", "schema": schema}}).output_text
    assert text.replace(" ", "").startswith('{"a"')


def _text_strict(server, client):
    base = {"input": "x", "text": {"format": {"type": "json_schema", "name": "x",
                                              "schema": {"type": "object", "properties": {"a": {}}}}}}
    open_ = _chat_request(ResponsesRequest.model_validate(base), [])
    base["text"]["format"]["strict"] = True
    strict = _chat_request(ResponsesRequest.model_validate(base), [])
    assert strict.response_format.json_schema.strict and not open_.response_format.json_schema.strict


def _effort(server, client):
    request = ResponsesRequest.model_validate({"input": "x", "reasoning": {"effort": "low"}})
    assert _chat_request(request, [{"role": "user", "content": "x"}]).chat_template_kwargs == {
        "reasoning_effort": "low"}  # vLLM's: the chat template reads it
    post(server, reasoning={"effort": "low"}).raise_for_status()


def _tool_description(server, client):
    bare = {k: v for k, v in TOOL.items() if k != "description"}
    with_tool = respond(client, input="Hi", tools=[TOOL], tool_choice="none").usage.input_tokens
    assert with_tool > respond(client, input="Hi", tools=[bare], tool_choice="none").usage.input_tokens


def _tool_choice_none(server, client):
    assert respond(client, input="Hi", tools=[TOOL], tool_choice="none").output[0].type == "message"


def _cache_salt(server, client):
    long = "paged attention " * 24
    cached = [respond(client, input=long, max_output_tokens=1, cache_salt=salt).usage.input_tokens_details
              .cached_tokens for salt in ("walk-a", "walk-a", "walk-b")]
    assert cached[1] and not cached[2]


def _request_id(server, client):
    assert respond(client, input="Hi", request_id="walk-id").id.startswith("resp_walk-id-")  # and a random part


def _chat_template_kwargs(server, client):
    request = ResponsesRequest.model_validate({"input": "x", "chat_template_kwargs": {"greeting": "hi"}})
    assert _chat_request(request, [{"role": "user", "content": "x"}]).chat_template_kwargs == {"greeting": "hi"}
    post(server, chat_template_kwargs={"greeting": "hi"}).raise_for_status()  # enable_thinking: the reasoning test


def _skip_special_tokens(server, client):
    forced = {"logit_bias": {"1": 100}, "ignore_eos": True, "max_output_tokens": 2}
    assert respond(client, input="Hi", **forced).output_text == ""
    assert respond(client, input="Hi", skip_special_tokens=False, **forced).output_text == "<|im_start|>" * 2


def _stop_token_ids(server, client):
    plain = client.chat.completions.create(messages=[{"role": "user", "content": "Hello world"}], max_tokens=12,
                                           **GREEDY, extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = plain.choices[0].token_ids
    cut = respond(client, input="Hello world", max_output_tokens=12, ignore_eos=True, stop_token_ids=[ids[3]])
    assert cut.usage.output_tokens == ids.index(ids[3]) + 1 and cut.status == "completed"


def _stop_str(include):
    def check(server, client):
        full = respond(client, input="Hello world", max_output_tokens=16, ignore_eos=True).output_text
        stop = full[4:7]
        cut = respond(client, input="Hello world", max_output_tokens=16, ignore_eos=True, stop=[stop],
                      include_stop_str_in_output=include).output_text
        assert cut == full[:full.index(stop)] + (stop if include else "")
    return check


ENTRIES = {
    "model": _model,
    "input": "test_text_messages_and_instructions_are_the_chat_completion",
    "instructions": "test_text_messages_and_instructions_are_the_chat_completion",
    "max_output_tokens": _max_output_tokens,
    "temperature": as_in_chat(temperature=1.5, seed=3),
    "top_p": as_in_chat(changes=False, temperature=1.5, seed=3, top_p=0.001),
    "tools": "test_function_tools_calls_and_outputs",
    "tools[].type": refused("tools[0].type", tools=[{"type": "web_search"}]),
    "tools[].name": "test_function_tools_calls_and_outputs",
    "tools[].description": _tool_description,
    "tools[].parameters": lambda s, c: schema_of() != schema_of(tools=[{**TOOL, "parameters": None}]),
    "tools[].strict": lambda s, c: schema_of() != schema_of(tools=[{**TOOL, "strict": True}]),
    "tool_choice": _tool_choice_none,
    "tool_choice.type": "test_function_tools_calls_and_outputs",
    "tool_choice.name": refused("tool_choice", tools=[TOOL], tool_choice={"type": "function", "name": "other"}),
    "parallel_tool_calls": lambda s, c: "maxItems" in schema_of(parallel_tool_calls=False),
    "stream": "test_sdk_stream_and_create_stream_send_openai_events",
    "store": _store,
    "previous_response_id": "test_previous_response_id_store_and_eviction",
    "metadata": _metadata,
    "user": no_effect(user="walk"),  # OpenAI's end-user id for abuse monitoring
    "safety_identifier": no_effect(safety_identifier="walk"),  # the same, OpenAI's newer name
    "prompt_cache_key": no_effect(prompt_cache_key="walk"),  # the prefix cache finds prefixes itself (vLLM too)
    "service_tier": no_effect(service_tier="default"),  # one tier here
    "text": _json_object,
    "text.format": _json_object,
    "text.format.type": _json_schema,
    "text.format.name": no_effect(text={"format": {"type": "text", "name": "walk"}}),  # names the format only
    "text.format.description": no_effect(text={"format": {"type": "text", "description": "walk"}}),
    "text.format.schema": _json_schema,
    "text.format.strict": _text_strict,
    "text.verbosity": refused("text.verbosity", text={"verbosity": "low"}),
    "reasoning": _effort,
    "reasoning.effort": _effort,
    "reasoning.summary": refused("reasoning.summary", reasoning={"summary": "auto"}),
    "reasoning.generate_summary": refused("reasoning.summary", reasoning={"generate_summary": "auto"}),
    "truncation": refused("truncation", truncation="auto"),
    "background": refused("background", background=True),
    "include": refused("include", include=["message.output_text.logprobs"]),
    "max_tool_calls": refused("max_tool_calls", max_tool_calls=1),
    "top_logprobs": refused("top_logprobs", top_logprobs=2),
    "prompt": refused("prompt", prompt={"id": "p"}),
    "conversation": refused("conversation", conversation="c"),
    "stream_options": refused("stream_options", stream=True, stream_options={"include_obfuscation": False}),
    "top_k": as_in_chat(temperature=1.5, seed=3, top_k=2),
    "min_p": as_in_chat(temperature=1.5, seed=3, min_p=0.5),
    "presence_penalty": as_in_chat(presence_penalty=2.0, ignore_eos=True),
    "frequency_penalty": as_in_chat(frequency_penalty=2.0, ignore_eos=True),
    "repetition_penalty": as_in_chat(repetition_penalty=2.0, ignore_eos=True),
    "seed": as_in_chat(temperature=1.0, seed=7),
    "stop": _stop_str(False),
    "include_stop_str_in_output": _stop_str(True),
    "stop_token_ids": _stop_token_ids,
    "ignore_eos": lambda s, c: respond(c, input="Hi", logit_bias={"2": 100}, ignore_eos=True).usage.output_tokens == 6,
    "logit_bias": as_in_chat(logit_bias={"65": 100}),
    "skip_special_tokens": _skip_special_tokens,
    "priority": refused("priority", priority=1),  # this server schedules fcfs (vLLM's check)
    "cache_salt": _cache_salt,
    "request_id": _request_id,
    "chat_template_kwargs": _chat_template_kwargs,
    "include_reasoning": "test_reasoning_server.py::test_responses_reasoning_items",  # needs a reasoning parser
}
"""Each field: its check, or the test that checks it."""


def test_every_field_has_an_entry():
    assert set(declared_fields(ResponsesRequest)) == set(ENTRIES)
    for check in ENTRIES.values():
        assert callable(check) or check in globals() or check.startswith("test_reasoning_server.py::")


def test_unknown_fields_and_items_are_refused(server):
    for fields, param in [({"foo": 1}, "foo"), ({"text": {"format": {"type": "text"}, "bar": 1}}, "text"),
                          ({"input": [{"role": "user", "content": "x", "extra": 1}]}, "input[0].extra"),
                          ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
                          ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
                           "input[0].content[0].type")]:
        response = post(server, **fields)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize("path", [p for p, check in ENTRIES.items() if callable(check)])
def test_field(server, client, path):
    result = ENTRIES[path](server, client)
    assert result is None or result is True, path


def test_openapi_documents_the_routes(server):
    paths = json.loads(server.get("/openapi.json").text)["paths"]
    assert "post" in paths["/v1/responses"] and "get" in paths["/v1/responses/{response_id}"]
