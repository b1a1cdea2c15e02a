"""Tool calling through a real `pagedllm serve` (tiny random model, hermes parser) and the official openai client:
required and named calls enforced by the structured-output backend, auto calls parsed from the output, streamed as
the SDK reassembles them, bad requests answered with a 400 naming the field, and (a second server, SmolLM2 with
--chat-template tool_chat_template_hermes.jinja) tools and tool messages rendered by the shipped template. A
random model writes what the grammar allows, so every enforced call must still be valid.

The tiny model's own template ignores tools, which keeps prompts inside its 512-token context (its small
vocabulary spends a token per 2 characters of JSON: the 5 tools rendered take ~1,600)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jsonschema_rs
import openai
import pytest
from server_utils import MODEL_NAME, RemoteServer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from tool_calling_validity import TOOLS, run_validity  # noqa: E402

pytestmark = pytest.mark.slow

WEATHER = TOOLS[0]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


SMALL_TOOL = {"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["utc", "local"]}}, "required": ["tz"]}}}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    server = RemoteServer(tiny_llama_dir, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                          "--max-num-seqs", "16")
    yield server
    server.close()


@pytest.fixture(scope="module")
def hermes_client(smollm2_server):
    """SmolLM2 (the embedded default) with the shipped template, which is for it: the tools' instructions alone
    would overflow the tiny model's context. Its --tool-call-parser is llama3_json: not the template's format, but
    one more server only to show the flag picks the parser would cost CI ~25 s. (The server is shared with the
    validity tests: conftest.smollm2_server.)"""
    return smollm2_server.client()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def create(client, stream=False, **kwargs):
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "temperature": 0.0, "max_tokens": 300,
              **kwargs}
    return client.chat.completions.create(stream=stream, **kwargs)


def assert_valid(calls, names=None):
    assert calls
    for call in calls:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
        assert names is None or call.function.name in names
        jsonschema_rs.validate(tool["function"]["parameters"], json.loads(call.function.arguments))


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_enforced_calls_stream_and_not(client, tool_choice):
    # one call: a random model never closes an open-ended array of calls (greedy, it repeats until max_tokens)
    whole = create(client, tool_choice=tool_choice, parallel_tool_calls=False).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == ""
    assert_valid(whole.message.tool_calls, None if tool_choice == "required" else {"get_weather"})
    # the SDK's stream helper reassembles the same calls from the deltas
    with client.chat.completions.stream(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                        temperature=0.0, max_tokens=300, parallel_tool_calls=False) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert len(whole.message.tool_calls) == 1
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed.message.tool_calls] == \
           [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]


def test_auto_parses_hermes_output_stream_and_not(client):
    # the output forced to one hermes block by a regex: what a model that calls a tool writes
    forced = {"structured_outputs": {"regex": HERMES_CALL.replace("{", "\\{").replace("}", "\\}")}}
    whole = create(client, tool_choice="auto", extra_body=forced).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    chunks = list(create(client, stream=True, tool_choice="auto", extra_body=forced))
    deltas = [tc for chunk in chunks for choice in chunk.choices for tc in choice.delta.tool_calls or []]
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id.startswith("chatcmpl-tool-") and first.type == "function"
    assert first.function.name == "get_weather"
    assert rest and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    assert json.loads(first.function.arguments + "".join(d.function.arguments for d in rest)) == {
        "city": "Paris", "unit": "celsius"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(choice.delta.content for chunk in chunks for choice in chunk.choices)


def forced(text: str) -> dict:
    """extra_body forcing the output to `text` (a regex of it): what a model that calls a tool writes."""
    return {"structured_outputs": {"regex": re.escape(text)}}


def test_tool_call_parser_flag_selects_the_parser(hermes_client):
    # --tool-call-parser llama3_json reads Llama's JSON calls, and hermes blocks are plain text to it
    llama_call = '{"name": "now", "parameters": {"tz": "utc"}}'
    hermes_call = '<tool_call>\n{"name": "now", "arguments": {"tz": "utc"}}\n</tool_call>'
    whole = create(hermes_client, tools=[SMALL_TOOL], tool_choice="auto", extra_body=forced(llama_call)).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
        ("now", {"tz": "utc"})]
    chunks = list(create(hermes_client, stream=True, tools=[SMALL_TOOL], tool_choice="auto",
                         extra_body=forced(llama_call)))
    deltas = [tc for chunk in chunks for choice in chunk.choices for tc in choice.delta.tool_calls or []]
    assert deltas[0].function.name == "now" and len(deltas) > 1
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"tz": "utc"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    hermes = create(hermes_client, tools=[SMALL_TOOL], tool_choice="auto", extra_body=forced(hermes_call)).choices[0]
    assert hermes.message.content == hermes_call and not hermes.message.tool_calls


def test_auto_without_a_call_is_plain_text(client):
    plain = create(client, max_tokens=8).choices[0]  # auto (the default with tools), the model writes no block
    assert plain.message.tool_calls in (None, []) and plain.finish_reason in ("length", "stop")


def test_shipped_template_renders_tools_calls_and_tool_messages(hermes_client):
    none = create(hermes_client, tools=[SMALL_TOOL], tool_choice="none", max_tokens=1)
    without_tools = hermes_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1)
    assert none.usage.prompt_tokens > without_tools.usage.prompt_tokens + 50  # none still renders the tools
    assert not none.choices[0].message.tool_calls
    call = create(hermes_client, tools=[SMALL_TOOL], tool_choice={"type": "function", "function": {"name": "now"}},
                  max_tokens=40).choices[0].message.tool_calls[0]
    assert json.loads(call.function.arguments)["tz"] in ("utc", "local")
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    reply = create(hermes_client, messages=history, tools=[SMALL_TOOL], tool_choice="none", max_tokens=1)
    assert reply.usage.prompt_tokens > none.usage.prompt_tokens + 20  # the call and its response rendered
    assert reply.choices[0].message.role == "assistant"


@pytest.mark.parametrize("body, param", [
    ({"tools": []}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"choice": ["a"]}}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(unclosed"}}}}}], "tool_choice": "required"}, "tools"),
])
def test_bad_tool_requests_are_400_naming_the_field(server, body, param):
    response = server.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_validity_ci_size(server):
    rows = run_validity(server.url + "/v1", requests_per_tool=1, concurrency=8, max_tokens=300,
                        parallel_tool_calls=False)
    assert [(r["mode"], r["temperature"]) for r in rows] == [("required", 0.0), ("required", 1.0), ("named", 0.0),
                                                             ("named", 1.0)]
    for row in rows:
        assert row["valid"] == row["total"] == len(TOOLS), row
