"""--reasoning-parser qwen3 on a real `pagedllm serve` with a tiny model whose tokenizer has `<think>`/`</think>`
(thinking_model.py), through the `openai` SDK: the reasoning split into `reasoning` / `reasoning_content` (whole and
streamed), `enable_thinking` through chat_template_kwargs, reasoning items of /v1/responses, and a grammar (a
json_schema response_format, tool_choice required) that constrains only the output after `</think>`.

The random model is steered with a logit_bias on `</think>` (greedy, so deterministic): +1.5 closes the reasoning
after a few tokens; the raw text (the same prompt through /v1/completions, which parses nothing) is the reference."""

from __future__ import annotations

import json

import pytest
from server_utils import MODEL_NAME, RemoteServer

from thinking_model import build_thinking_model

HELLO = [{"role": "user", "content": "Hello world"}]
GREEDY = {"model": MODEL_NAME, "temperature": 0.0}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["utc", "local"]}}, "required": ["tz"]}}}


@pytest.fixture(scope="module")
def thinking(tiny_llama_padded_dir, tmp_path_factory):
    folder, _, end = build_thinking_model(tiny_llama_padded_dir, tmp_path_factory.mktemp("thinking"))
    server = RemoteServer(folder, "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
                          "--tool-call-parser", "hermes")
    yield server, server.client(), {str(end): 1.5}
    server.close()


def raw_text(server, client, bias, max_tokens: int, **kwargs) -> str:
    """The output with nothing parsed: the chat prompt (as /tokenize renders it) through /v1/completions."""
    prompt = server.post("/tokenize", json={"model": MODEL_NAME, "messages": HELLO, **kwargs}).json()["tokens"]
    return client.completions.create(prompt=prompt, max_tokens=max_tokens, logit_bias=bias, **GREEDY).choices[0].text


def test_chat_reasoning_whole_and_streamed(thinking):
    server, client, bias = thinking
    raw = raw_text(server, client, bias, 16)
    reasoning, content = raw.split("</think>", 1)
    assert reasoning and content  # the bias closed the reasoning after a few tokens
    message = client.chat.completions.create(messages=HELLO, max_tokens=16, logit_bias=bias,
                                             **GREEDY).choices[0].message
    assert message.reasoning == message.reasoning_content == reasoning  # vLLM 0.32's name, and the older one
    assert message.content == content.replace("</think>", "")  # qwen3 drops a later </think>
    chunks = list(client.chat.completions.create(messages=HELLO, max_tokens=16, logit_bias=bias, stream=True,
                                                 **GREEDY))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == reasoning
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == message.content
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert not any(getattr(d, "reasoning", None) for d in deltas[first_content:])  # reasoning first, then content


def test_enable_thinking_false_reaches_the_template(thinking):
    server, client, bias = thinking
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    response = client.chat.completions.create(messages=HELLO, max_tokens=8, **GREEDY, extra_body=off)
    on = client.chat.completions.create(messages=HELLO, max_tokens=8, **GREEDY)
    assert response.usage.prompt_tokens > on.usage.prompt_tokens  # the template wrote <think>\n\n</think>\n\n
    message = response.choices[0].message
    assert message.content == raw_text(server, client, None, 8, **off) and getattr(message, "reasoning", None) is None


def test_grammar_constrains_only_after_the_reasoning(thinking):
    server, client, bias = thinking
    reasoning = raw_text(server, client, bias, 16).split("</think>", 1)[0]
    format_ = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    message = client.chat.completions.create(messages=HELLO, max_tokens=24, logit_bias=bias, response_format=format_,
                                             **GREEDY).choices[0].message
    # the reasoning is the unconstrained one (not JSON: the grammar was off), the content is the grammar's
    assert message.reasoning == reasoning and message.content.replace(" ", "").startswith('{"a":')
    first = client.chat.completions.create(messages=HELLO, max_tokens=12, logit_bias={k: 100 for k in bias},
                                           response_format=format_, **GREEDY).choices[0].message
    # </think> first (a token the grammar refuses: it was off), then the grammar took over and refused later ones
    assert getattr(first, "reasoning", None) is None and first.content.replace(" ", "").startswith('{"a":')
    # /v1/completions too, as vLLM's engine gates every constrained request (the prompt opened <think>)
    prompt = server.post("/tokenize", json={"model": MODEL_NAME, "messages": HELLO}).json()["tokens"]
    text = client.completions.create(prompt=prompt, max_tokens=24, logit_bias=bias, **GREEDY,
                                     extra_body={"response_format": format_}).choices[0].text
    assert text.split("</think>", 1)[0] == reasoning and text.split("</think>", 1)[1].replace(" ", "").startswith(
        '{"a":')
    call = client.chat.completions.create(messages=HELLO, max_tokens=40, logit_bias=bias, tools=[TOOL],
                                          tool_choice="required", **GREEDY).choices[0].message
    assert call.reasoning == reasoning and call.tool_calls[0].function.name == "now"


def test_responses_reasoning_items(thinking):
    server, client, bias = thinking
    message = client.chat.completions.create(messages=HELLO, max_tokens=16, logit_bias=bias,
                                             **GREEDY).choices[0].message
    extra = {"logit_bias": bias}
    response = client.responses.create(input="Hello world", max_output_tokens=16, **GREEDY, extra_body=extra)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == message.reasoning and response.output_text == message.content
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    with client.responses.stream(input="Hello world", max_output_tokens=16, **GREEDY, extra_body=extra) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == message.reasoning
    assert json.loads(final.model_dump_json())["output"][0]["content"][0]["text"] == message.reasoning
    assert final.output_text == message.content
    hidden = client.responses.create(input="Hello world", max_output_tokens=16, **GREEDY,
                                     extra_body={**extra, "include_reasoning": False})
    assert [item.type for item in hidden.output] == ["message"] and hidden.output_text == message.content
    off = client.responses.create(input="Hello world", max_output_tokens=8, **GREEDY,
                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert [item.type for item in off.output] == ["message"] and off.usage.input_tokens > response.usage.input_tokens
