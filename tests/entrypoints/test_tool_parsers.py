"""The tool call parsers (`--tool-call-parser`) without a server: each reads 0, 1 and 2 calls and the content
before them out of a finished output, leaves malformed calls as content, and streams deltas that the OpenAI SDK
reassembles (fed a character, or a few, at a time) into the non-streamed message; the flag picks the parser, and
an unknown name is refused at start-up."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from pagedllm.config import ServerConfig
from pagedllm.config.server import TOOL_CALL_PARSERS
from pagedllm.entrypoints.openai.chat_protocol import (
    ChatCompletionRequest,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
)
from pagedllm.entrypoints.openai.tool_calling import ToolCalling
from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser, qwen3_xml
from pagedllm.sampling_params import SamplingParams

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
TYPED = {"type": "function", "function": {"name": "typed", "parameters": {"type": "object", "properties": {
    "n": {"type": "number"}, "flag": {"type": "boolean"}, "obj": {"type": "object"}, "items": {"type": "array"},
    "s": {"type": "string"}}}}}
TOOLS = [WEATHER, NOW, TYPED]
PARIS = ("get_weather", {"city": "Paris", "days": 2})
ROME = ("get_weather", {"city": "Rome"})
CALL_NOW = ("now", {})

# (parser, output, content of the message, calls as (name, arguments))
CASES = [
    ("hermes", "Just text, no call.", "Just text, no call.", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
     None, [PARIS]),
    ("hermes", 'Let me see.<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>\n'
               '<tool_call>{"name": "now", "arguments": {}}</tool_call>', "Let me see.", [ROME, CALL_NOW]),
    ("hermes", '<tool_call>{"name": get_weather}</tool_call>', '<tool_call>{"name": get_weather}</tool_call>', []),

    ("llama3_json", "It is {probably} sunny.", "It is {probably} sunny.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', None, [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                    '{"name": "now", "arguments": {}}', None, [ROME, CALL_NOW]),
    ("llama3_json", 'Checking. <|python_tag|>{"name": "now", "parameters": {}}', "Checking. ", [CALL_NOW]),
    ("llama3_json", '{"name": get_weather, "parameters": {}}', '{"name": get_weather, "parameters": {}}', []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),

    ("mistral", "No call [TOOL here.", "No call [TOOL here.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]', None, [PARIS]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                '{"name": "now", "arguments": {}}]', "Sure. ", [ROME, CALL_NOW]),
    ("mistral", '[TOOL_CALLS][{name: "now"}]', '[TOOL_CALLS][{name: "now"}]', []),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris", "days": 2}', None, [PARIS]),  # tokenizer v11
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS] {"city": "Rome"}[TOOL_CALLS]now[ARGS]{}', "Sure. ",
     [ROME, CALL_NOW]),  # v13
    ("mistral", '[TOOL_CALLS]{"city": "Rome"}', '[TOOL_CALLS]{"city": "Rome"}', []),

    ("qwen3_xml", "Plain <b>text</b> < function.", "Plain <b>text</b> < function.", []),
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
                  "</parameter>\n</function>\n</tool_call>", None, [PARIS]),
    ("qwen3_xml", "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
                  "</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>",
     "Let me check.\n", [ROME, CALL_NOW]),
    ("qwen3_xml", "<tool_call>\n<function=typed>\n<parameter=n>\n1.5\n</parameter>\n<parameter=flag>\nTrue\n"
                  "</parameter>\n<parameter=obj>\n{\"a\": [1, 2]}\n</parameter>\n<parameter=items>\nnot json\n"
                  "</parameter>\n<parameter=s>\n 42 \n</parameter>\n<parameter=extra>\n7\n</parameter>\n"
                  "<parameter=days>\nnull\n</parameter>\n</function>\n</tool_call>",
     None, [("typed", {"n": 1.5, "flag": True, "obj": {"a": [1, 2]}, "items": "not json", "s": " 42 ",
                       "extra": "7", "days": None})]),
    ("qwen3_xml", "<tool_call>\nnot a function\n</tool_call>", "<tool_call>\nnot a function\n</tool_call>", []),
]


def tool_calling(parser: str, **fields) -> ToolCalling:
    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser=parser)
    return ToolCalling(ChatCompletionRequest(messages=[{"role": "user", "content": "?"}], tools=TOOLS, **fields),
                       config)


def streamed(tools: ToolCalling, text: str, pieces: int):
    """The text streamed in `pieces`-character deltas: the tool call deltas sent, and the choice the OpenAI SDK's
    stream state reassembles from the chunks."""
    state = ChatCompletionStreamState()
    stream = tools.stream()
    sent = []

    def feed(delta: DeltaMessage, reason: str | None) -> None:
        sent.extend(delta.tool_calls or [])
        chunk = ChatCompletionStreamResponse(id="chatcmpl-1", created=0, model="m", choices=[
            ChatCompletionStreamChoice(index=0, delta=delta, finish_reason=reason)])
        state.handle_chunk(ChatCompletionChunk.model_validate(json.loads(chunk.model_dump_json())))

    feed(DeltaMessage(role="assistant", content=""), None)
    for start in range(0, len(text), pieces):
        last = start + pieces >= len(text)
        delta, reason = stream.delta(text[start:start + pieces], "stop" if last else None)
        if delta is not None:
            feed(delta, reason)
    return sent, state.get_final_completion().choices[0]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_extraction_and_stream(parser, text, content, calls):
    tools = tool_calling(parser)
    message, finish_reason = tools.message(text, "stop")
    assert message.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == calls
    assert finish_reason == ("tool_calls" if calls else "stop")
    for pieces in (1, 5):
        sent, choice = streamed(tools, text, pieces)
        assert (choice.message.content or None) == content
        assert choice.finish_reason == finish_reason
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []] == \
            calls
        if parser == "qwen3_xml":  # the pieces add up to the very same text
            assert [c.function.arguments for c in choice.message.tool_calls or []] == \
                [c.function.arguments for c in message.tool_calls]
        for index in range(len(calls)):  # per call: the name and id first, then argument text only
            deltas = [d for d in sent if d.index == index]
            assert deltas[0].id.startswith("chatcmpl-tool-") and deltas[0].function.name == calls[index][0]
            assert all(d.id is None and d.function.name is None for d in deltas[1:])
            if pieces == 1 and calls[index][1]:
                assert len(deltas) > 2  # arguments streamed as they grow, not in one piece at the end


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>{"name": "now", "arguments": {]}</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": }}'),
    ("mistral", '[TOOL_CALLS][{"name": "now", "arguments": {]'),
    ("mistral", '[TOOL_CALLS]{"name": "now", "arguments": {}}'),  # not an array
    ("mistral", '[TOOL_CALLS]now{"a": }'),
    ("mistral", '[TOOL_CALLS]now[ARGS][1]'),  # arguments not an object
])
def test_bad_arguments_leave_the_output_as_content(parser, text):
    # (a stream has sent the call's name by the time its arguments go wrong, as vLLM's has)
    message, finish_reason = tool_calling(parser).message(text, "stop")
    assert message.content == text and not message.tool_calls and finish_reason == "stop"


@pytest.mark.parametrize("parser, partial, held", [
    ("hermes", "Hi <tool_", "Hi "),
    ("llama3_json", "Hi <|python", "Hi "),
    ("llama3_json", "  ", ""),  # a call may still begin
    ("mistral", "Hi [TOOL_CA", "Hi "),
    ("qwen3_xml", "Hi <funct", "Hi "),
    ("qwen3_xml", "Hi <tool_c", "Hi "),
])
def test_stream_holds_back_a_possible_start(parser, partial, held):
    module = get_tool_parser(parser)
    assert module.stream_state(partial, False, None) == (held, [])
    assert module.stream_state(partial, True, None) == (partial, [])


def test_qwen3_stream_sends_a_parameter_once_it_has_closed():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    assert [(c.name, c.arguments) for c in qwen3_xml.stream_state(text, False, None)[1]] == [("get_weather", "{")]
    text += "is\n</parameter>\n<parameter=days>\n3\n</param"
    assert qwen3_xml.stream_state(text, False, None)[1][0].arguments == '{"city": "Paris"'
    text += "eter>\n</funct"
    assert qwen3_xml.stream_state(text, False, None)[1][0].arguments == '{"city": "Paris", "days": "3"'
    assert qwen3_xml.stream_state(text + "ion>", False, None)[1][0].arguments == '{"city": "Paris", "days": "3"}'


@pytest.mark.parametrize("parser", list(TOOL_CALL_PARSERS))
def test_the_flag_selects_the_parser(parser):
    tools = tool_calling(parser)
    assert tools.parser is get_tool_parser(parser)
    # each parser reads its own format only
    one_call = {text: p for p, text, _, calls in CASES if len(calls) == 1 and calls[0] == PARIS}
    own = {name: next(text for text, p in one_call.items() if get_tool_parser(p) is get_tool_parser(name))
           for name in TOOL_CALL_PARSERS}
    for name, text in own.items():
        calls = tools.message(text, "stop")[0].tool_calls
        assert bool(calls) == (get_tool_parser(name) is tools.parser), (name, text)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_are_plain_json_whatever_the_parser(choice):
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}]' if choice == "required" else \
        '{"city": "Paris", "days": 2}'
    for parser in TOOL_CALL_PARSERS:
        tools = tool_calling(parser, tool_choice=choice)
        assert tools.parser is None and tools.schema == tool_calling("hermes", tool_choice=choice).schema
        message, _ = tools.message(text, "stop")
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [PARIS]


def test_mistral_keeps_special_tokens_for_auto_only():
    params = SamplingParams(max_tokens=4)
    assert asyncio.run(tool_calling("mistral").constrain(params, 5.0)).skip_special_tokens is False
    assert asyncio.run(tool_calling("hermes").constrain(params, 5.0)).skip_special_tokens is True
    assert asyncio.run(tool_calling("mistral", tool_choice="none").constrain(params, 5.0)).skip_special_tokens


def test_an_unknown_parser_is_refused_at_start_up():
    from pagedllm.entrypoints.cli.serve import add_parser, configs_from_args

    parser = add_parser(argparse.ArgumentParser(prog="pagedllm").add_subparsers())
    args = parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "nope"])
    with pytest.raises(ValueError) as e:
        configs_from_args(args)
    assert "--tool-call-parser 'nope'" in str(e.value)
    assert all(name in str(e.value) for name in TOOL_CALL_PARSERS)
