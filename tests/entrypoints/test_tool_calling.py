"""Tool calling without a server: the request checks (400 and the field they name), vLLM's schemas for required
and a named function, the hermes parser, stream deltas reassembled by the OpenAI SDK's own stream state into the
message the non-streaming path returns, and the shipped Hermes template."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from pagedllm.config import ServerConfig
from pagedllm.config.server import TOOL_CALL_PARSERS
from pagedllm.entrypoints.openai import chat_template
from pagedllm.entrypoints.openai.chat_protocol import (
    ChatCompletionRequest,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
)
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.tool_calling import ToolCalling
from pagedllm.entrypoints.openai.tool_parsers import hermes
from pagedllm.entrypoints.openai.tool_parsers.partial_calls import scan_calls
from pagedllm.sampling_params import SamplingParams

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, NOW]
AUTO = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def tool_calling(config: ServerConfig = AUTO, **fields) -> ToolCalling:
    return ToolCalling(ChatCompletionRequest(messages=MESSAGES, **fields), config)


@pytest.mark.parametrize("fields, config, param", [
    ({"tools": []}, AUTO, "tools"),
    ({"tool_choice": "required"}, AUTO, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, AUTO, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, AUTO, "tool_choice"),
    ({"tools": TOOLS}, ServerConfig(), "tool_choice"),  # auto (the default with tools) needs the flags
    ({"tools": TOOLS, "tool_choice": "auto"}, ServerConfig(), "tool_choice"),
])
def test_bad_tool_requests_name_the_field(fields, config, param):
    with pytest.raises(APIError) as e:
        tool_calling(config, **fields)
    assert e.value.status == 400 and e.value.param == param, e.value.message


@pytest.mark.parametrize("constraint", [{"structured_outputs": {"regex": "a+"}},
                                        {"response_format": {"type": "json_object"}}, {"guided_regex": "a+"}])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "now"}}])
def test_named_or_required_with_another_constraint_is_refused(constraint, choice):
    with pytest.raises(APIError) as e:
        tool_calling(tools=TOOLS, tool_choice=choice, **constraint)
    assert e.value.param == "tool_choice"
    tool_calling(tools=TOOLS, tool_choice="auto", **constraint)  # auto parses free output: allowed, as in vLLM
    tool_calling(tools=TOOLS, tool_choice=choice, response_format={"type": "text"})


def test_modes_and_template_tools():
    assert tool_calling(tool_choice="none").mode == "none"  # none needs no tools
    none = tool_calling(tools=TOOLS, tool_choice="none")
    assert none.mode == "none" and none.template_tools[0]["function"]["name"] == "get_weather"
    excluded = tool_calling(ServerConfig(exclude_tools_when_tool_choice_none=True), tools=TOOLS, tool_choice="none")
    assert excluded.template_tools is None
    assert tool_calling(tools=TOOLS).mode == "auto"
    assert tool_calling(tools=TOOLS, tool_choice="required").mode == "required"


def constrained(tools: ToolCalling) -> SamplingParams:
    return asyncio.run(tools.constrain(SamplingParams(), timeout_s=10.0))


def test_required_and_named_schemas_are_vllms():
    schema = constrained(tool_calling(tools=TOOLS, tool_choice="required")).structured_outputs.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    first, second = schema["items"]["anyOf"]
    assert first["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert first["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert second["properties"]["parameters"] == {"type": "object", "properties": {}}  # no parameters: {}
    assert first["required"] == ["name", "parameters"] and first["additionalProperties"] is False
    single = tool_calling(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).schema
    assert single["maxItems"] == 1
    named = tool_calling(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.schema == WEATHER["function"]["parameters"]
    assert constrained(tool_calling(tools=TOOLS, tool_choice="auto")).structured_outputs is None


def test_a_tool_schema_the_backend_cannot_compile_is_a_400_on_tools():
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(unclosed"}}}}}
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(APIError) as e:
            constrained(tool_calling(tools=[bad], tool_choice=choice))
        assert e.value.param == "tools", e.value.message


def test_malformed_tool_definitions_are_rejected_by_the_model():
    from pydantic import ValidationError

    for tools in ([{"type": "function"}], [{"type": "retrieval", "function": {"name": "f"}}],
                  [{"type": "function", "function": {"name": ""}}],
                  [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]):
        with pytest.raises(ValidationError) as e:
            ChatCompletionRequest(messages=MESSAGES, tools=tools)
        assert e.value.errors()[0]["loc"][0] == "tools"


def test_hermes_extracts_calls_and_content():
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "now", "arguments": {}}'
    content, calls = hermes.extract_tool_calls(text)
    assert content == "Let me check."
    assert calls == [("get_weather", '{"city": "Paris"}'), ("now", "{}")]
    assert hermes.extract_tool_calls("no calls here") is None
    assert hermes.extract_tool_calls("<tool_call>{not json}</tool_call>") is None


def test_hermes_stream_holds_back_a_possible_start():
    assert hermes.stream_state("Hello <tool_", finished=False) == ("Hello ", [])
    assert hermes.stream_state("Hello <tool_", finished=True) == ("Hello <tool_", [])
    content, calls = hermes.stream_state('Hi<tool_call>{"name": "now", "argu', finished=False)
    assert content == "Hi" and calls[0].name == "now" and calls[0].arguments == ""


def test_scan_calls_arguments_only_grow():
    text = ('[{"name": "get_weather", "parameters": {"city": "Pa\\"ris}", "days": 3}} , '
            '{"parameters": 7, "name": "now"}]')
    previous: list[str] = []
    for end in range(len(text) + 1):
        calls = scan_calls(text[:end], "parameters", in_array=True)
        for old, call in zip(previous, calls, strict=False):
            assert call.arguments.startswith(old)
        previous = [call.arguments for call in calls]
    assert [(c.name, json.loads(c.arguments), c.complete) for c in calls] == [
        ("get_weather", {"city": 'Pa"ris}', "days": 3}, True), ("now", 7, True)]


def _reassembled(tools: ToolCalling, text: str, pieces: int, finish_reason: str = "stop"):
    """The text streamed in `pieces`-character deltas, each chunk through the OpenAI SDK's stream state."""
    state = ChatCompletionStreamState()
    stream = tools.stream()

    def feed(delta: DeltaMessage, reason: str | None) -> None:
        chunk = ChatCompletionStreamResponse(id="chatcmpl-1", created=0, model="m", choices=[
            ChatCompletionStreamChoice(index=0, delta=delta, finish_reason=reason)])
        state.handle_chunk(ChatCompletionChunk.model_validate(json.loads(chunk.model_dump_json())))

    feed(DeltaMessage(role="assistant", content=""), None)
    for start in range(0, len(text), pieces):
        last = start + pieces >= len(text)
        delta, reason = stream.delta(text[start:start + pieces], finish_reason if last else None)
        if delta is not None:
            feed(delta, reason)
    return state.get_final_completion().choices[0]


@pytest.mark.parametrize("pieces", [1, 3, 1000])
@pytest.mark.parametrize("fields, text", [
    ({"tool_choice": "required"},
     '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}, {"name": "now", "parameters": {}}]'),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, '{"city": "Oslo"}'),
    ({"tool_choice": "auto"}, 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
                              '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'),
    ({"tool_choice": "auto"}, "No tools needed <tool but text."),
    ({"tool_choice": "required"}, '[{"name": "get_w'),  # cut short: plain content
])
def test_stream_reassembles_to_the_non_streamed_message(fields, text, pieces):
    tools = tool_calling(tools=TOOLS, **fields)
    message, finish_reason = tools.message(text, "stop")
    choice = _reassembled(tools, text, pieces)
    assert choice.finish_reason == finish_reason
    streamed_calls = choice.message.tool_calls or []
    assert [c.function.name for c in streamed_calls] == [c.function.name for c in message.tool_calls]
    for streamed, whole in zip(streamed_calls, message.tool_calls, strict=True):
        assert json.loads(streamed.function.arguments) == json.loads(whole.function.arguments)
        assert streamed.id.startswith("chatcmpl-tool-") and streamed.type == "function"
    assert (choice.message.content or "") == (message.content or "")
    assert finish_reason == ("tool_calls" if message.tool_calls else "stop")


def test_parallel_tool_calls_false_keeps_the_first_call():
    tools = tool_calling(tools=TOOLS, tool_choice="auto", parallel_tool_calls=False)
    text = '<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>{"name": "now", "arguments": {}}'
    message, _ = tools.message(text, "stop")
    assert len(message.tool_calls) == 1
    assert len(_reassembled(tools, text, 2).message.tool_calls) == 1


def test_length_cut_named_call_finishes_with_length():
    tools = tool_calling(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message, finish_reason = tools.message('{"city": "Os', "length")
    assert finish_reason == "length" and message.tool_calls[0].function.arguments == '{"city": "Os'


def _render(source: str, messages, tools=None) -> str:
    return chat_template.render(source, messages, add_generation_prompt=True, continue_final_message=False,
                                special_tokens={}, tools=tools, timeout_s=5.0, max_chars=1 << 20)


def test_shipped_template_round_trips_tool_calls_and_tool_messages():
    source = chat_template.load_chat_template("tool_chat_template_hermes.jinja")
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "chatcmpl-tool-a", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "chatcmpl-tool-b", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-a", "content": "21 C"},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-b", "content": "25 C"},
    ]
    text = _render(source, conversation, [WEATHER])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n") and text.count("<|im_start|>system") == 1
    assert '<tools>\n{"name": "get_weather", "description": "The weather in a city."' in text
    # the assistant's calls render as the blocks the hermes parser reads back
    assistant = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert hermes.extract_tool_calls(assistant)[1] == [("get_weather", '{"city": "Paris"}'),
                                                       ("get_weather", '{"city": "Rome"}')]
    # consecutive tool messages: one user turn, each response with its call's name and id
    user_turn = text.split("<|im_start|>user\n<tool_response>")[1].split("<|im_end|>")[0]
    responses = [json.loads(block.split("</tool_response>")[0])
                 for block in ("<tool_response>" + user_turn).split("<tool_response>\n")[1:]]
    assert responses == [{"name": "get_weather", "tool_call_id": "chatcmpl-tool-a", "content": "21 C"},
                         {"name": "get_weather", "tool_call_id": "chatcmpl-tool-b", "content": "25 C"}]
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    # without tools: plain ChatML
    assert _render(source, MESSAGES) == "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"


def test_shipped_template_renders_as_transformers_does(tiny_llama_dir):
    from transformers import AutoTokenizer

    source = chat_template.load_chat_template("tool_chat_template_hermes.jinja")
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    conversation = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "x", "content": "noon"}]
    expected = tokenizer.apply_chat_template(conversation, tools=TOOLS, chat_template=source, tokenize=False,
                                             add_generation_prompt=True)
    assert _render(source, conversation, TOOLS) == expected


def test_load_chat_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert chat_template.load_chat_template(str(path)) == "{{ messages }}"
    assert chat_template.load_chat_template("{{ 'inline' }}") == "{{ 'inline' }}"
    with pytest.raises(ValueError, match="neither a readable file"):
        chat_template.load_chat_template("missing.jinja")


def test_tool_flags_are_checked_at_start_up():
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError) as e:
        ServerConfig(enable_auto_tool_choice=True, tool_call_parser="mistral_v2")
    assert str(e.value) == ("--tool-call-parser 'mistral_v2' is not a registered tool call parser; the registered "
                            "ones are hermes, llama3_json, llama4_json, mistral, qwen3_xml, qwen3_coder.")
    for name in TOOL_CALL_PARSERS:
        ServerConfig(enable_auto_tool_choice=True, tool_call_parser=name)
