"""Every declared field of the request models of /v1/completions and /v1/chat/completions, walked: each one either
changes the outcome as documented, or is refused with a 400 naming it, or (a short list, each with its reason) is
documented to leave the output alone, as it does in vLLM and OpenAI. A field added to CompletionRequest,
ChatCompletionRequest or a model nested in them (stream_options, response_format, tools, ...) without an entry in
FIELDS fails `test_every_declared_field_has_an_entry`.

The checks run against one real `pagedllm serve` (the tiny random model; its tokenizer adds a BOS token so that
`add_special_tokens` shows; a chat template that renders tools and a `greeting` variable; request templates trusted;
the hermes tool parser). Options of a constraint's grammar (whitespace, closed objects, parallel calls) are checked
on the grammar the request compiles to, on a server whose own JSON options are off, since a random model's text says
little about them; their effect on text is tested in tests/structured_output/test_json_options.py."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from request_fields import declared_fields
from server_utils import MODEL_NAME, RemoteServer

from pagedllm.config import ServerConfig
from pagedllm.entrypoints.openai.chat_protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.structured_outputs import structured_outputs_of
from pagedllm.entrypoints.openai.tool_calling import ToolCalling
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.grammar import grammar_of

COMPLETIONS, CHAT = "completions", "chat"
MODELS = {COMPLETIONS: CompletionRequest, CHAT: ChatCompletionRequest}
BASE = {COMPLETIONS: {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0.0},
        CHAT: {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 8,
               "temperature": 0.0}}
EOS, BOS = 2, 1  # the tiny tokenizer's <|im_end|> and <|im_start|>
TOOL = {"type": "function", "function": {"name": "now", "description": "The time.", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["utc", "local"]}}, "required": ["tz"]}}}
NAMED = {"type": "function", "function": {"name": "now"}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TEMPLATE = ("{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
            "{% if greeting is defined %}{{ greeting }}\n{% endif %}"
            "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ---- the server and its calls -----------------------------------------------------------------------------


class Api:
    def __init__(self, server: RemoteServer):
        self.server = server

    def post(self, endpoint: str, **fields) -> httpx.Response:
        path = "/v1/completions" if endpoint == COMPLETIONS else "/v1/chat/completions"
        return self.server.post(path, json={**BASE[endpoint], **fields}, timeout=60.0)

    def ok(self, endpoint: str, **fields) -> dict:
        response = self.post(endpoint, **fields)
        assert response.status_code == 200, response.text
        return response.json()

    def chunks(self, endpoint: str, **fields) -> list[dict]:
        body = self.post(endpoint, stream=True, **fields)
        assert body.status_code == 200, body.text
        events = [line[6:] for line in body.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]

    def refused(self, endpoint: str, param: str, **fields) -> None:
        response = self.post(endpoint, **fields)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param, response.text


def text(response: dict, endpoint: str, index: int = 0) -> str:
    choice = response["choices"][index]
    return choice["text"] if endpoint == COMPLETIONS else choice["message"]["content"] or ""


def token_ids(response: dict) -> list[int]:
    return response["choices"][0]["token_ids"]


def grammar(endpoint: str, **fields) -> str | None:
    """The grammar a request compiles to on a server whose JSON options are off (open objects, free whitespace):
    the request model, its structured outputs or tool calling, then grammar_of."""
    request = MODELS[endpoint].model_validate({**BASE[endpoint], **fields})
    params, _ = structured_outputs_of(request)
    if endpoint == CHAT and request.tools:
        config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
        schema = ToolCalling(request, config).schema
        params = StructuredOutputsParams(json=schema) if schema is not None else params
    return None if params is None else grammar_of(params, disable_any_whitespace=False,
                                                  disable_additional_properties=False)


# ---- the checks -------------------------------------------------------------------------------------------


@dataclass
class Entry:
    """How one field is honoured: `check(api, endpoint)` asserts it. kind: honoured (the outcome changes as
    documented), refused (a non-default value is a 400 naming it) or no_effect (documented: it changes nothing,
    in vLLM and OpenAI alike; `reason` says why)."""

    kind: str
    check: Callable[[Api, str], None]
    reason: str = ""


def honoured(check: Callable[[Api, str], None]) -> Entry:
    return Entry("honoured", check)


def refused(param: str, **fields) -> Entry:
    return Entry("refused", lambda api, ep: api.refused(ep, param, **fields))


def no_effect(reason: str, **fields) -> Entry:
    def check(api: Api, endpoint: str) -> None:
        assert api.ok(endpoint, **fields)["choices"] == api.ok(endpoint)["choices"]

    return Entry("no_effect", check, reason)


def grammar_changes(**fields) -> Entry:
    """Accepted by the server, and the request's grammar differs from the one without the field."""
    def check(api: Api, endpoint: str) -> None:
        base = {k: v for k, v in fields.items() if k.startswith("_base_")}
        extra = {k: v for k, v in fields.items() if not k.startswith("_base_")}
        base = {k.removeprefix("_base_"): v for k, v in base.items()}
        api.ok(endpoint, **{**base, **extra, "max_tokens": 2})
        assert grammar(endpoint, **{**base, **extra}) != grammar(endpoint, **base)

    return Entry("honoured", check)


def _model(api, ep):
    api.ok(ep, model=MODEL_NAME)
    response = api.post(ep, model="no-such-model")
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


def _n(api, ep):
    assert len(api.ok(ep, n=3, temperature=1.0, seed=1)["choices"]) == 3


def _temperature(api, ep):
    greedy = text(api.ok(ep, max_tokens=16), ep)
    assert any(text(api.ok(ep, temperature=1.5, seed=s, max_tokens=16), ep) != greedy for s in range(4))


def _equals_greedy(**fields):
    def check(api, ep):
        greedy = text(api.ok(ep, max_tokens=16), ep)
        assert all(text(api.ok(ep, temperature=1.5, seed=s, max_tokens=16, **fields), ep) == greedy for s in range(3))
    return check


def _penalty(name):
    def check(api, ep):
        plain = api.ok(ep, max_tokens=32, ignore_eos=True, return_token_ids=True)
        assert token_ids(api.ok(ep, max_tokens=32, ignore_eos=True, return_token_ids=True, **{name: 2.0})) != \
            token_ids(plain)
    return check


def _seed(api, ep):
    runs = [text(api.ok(ep, temperature=1.0, seed=s, max_tokens=16), ep) for s in (5, 5, 6, 7, 8)]
    assert runs[0] == runs[1] and len(set(runs[1:])) > 1


def _stop(include: bool):
    def check(api, ep):
        full = text(api.ok(ep, max_tokens=24, ignore_eos=True), ep)
        stop = full[6:9]
        cut = api.ok(ep, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=include)
        expected = full[:full.index(stop)] + (stop if include else "")
        assert text(cut, ep) == expected and cut["choices"][0]["finish_reason"] == "stop"
    return check


def _streamed_text(chunks: list[dict], ep: str) -> str:
    return "".join(c["choices"][0]["text"] if ep == COMPLETIONS else c["choices"][0]["delta"].get("content") or ""
                   for c in chunks if c["choices"])


def _stream(api, ep):
    assert _streamed_text(api.chunks(ep, max_tokens=12), ep) == text(api.ok(ep, max_tokens=12), ep)


def _include_usage(api, ep):
    chunks = api.chunks(ep, max_tokens=6, ignore_eos=True, stream_options={"include_usage": True})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(c.get("usage") is None for c in chunks[:-1])


def _continuous_usage(api, ep):
    chunks = api.chunks(ep, max_tokens=6, ignore_eos=True, stream_options={"continuous_usage_stats": True})
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["prompt_tokens"] > 0 for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 6


def _logit_bias(api, ep):
    forced = api.ok(ep, logit_bias={"65": 100}, ignore_eos=True, return_token_ids=True)
    assert set(token_ids(forced)) == {65}


def _ignore_eos(api, ep):
    assert api.ok(ep, logit_bias={str(EOS): 100})["usage"]["completion_tokens"] == 1
    assert api.ok(ep, logit_bias={str(EOS): 100}, ignore_eos=True)["usage"]["completion_tokens"] == 8


def _min_tokens(api, ep):
    # five tokens other than EOS, then EOS (counted, as vLLM counts it)
    assert api.ok(ep, logit_bias={str(EOS): 100}, min_tokens=5)["usage"]["completion_tokens"] == 6


def _stop_token_ids(api, ep):
    ids = token_ids(api.ok(ep, ignore_eos=True, return_token_ids=True, max_tokens=12))
    stop = ids[3]
    cut = api.ok(ep, ignore_eos=True, return_token_ids=True, max_tokens=12, stop_token_ids=[stop])
    assert token_ids(cut) == ids[:ids.index(stop) + 1]
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["choices"][0]["stop_reason"] == stop


def _skip_special_tokens(api, ep):
    forced = {"logit_bias": {str(BOS): 100}, "ignore_eos": True, "max_tokens": 2}
    assert text(api.ok(ep, **forced), ep) == ""
    assert text(api.ok(ep, skip_special_tokens=False, **forced), ep) == "<|im_start|><|im_start|>"


def _spaces_between_special_tokens(api, ep):
    forced = {"logit_bias": {str(BOS): 100}, "ignore_eos": True, "max_tokens": 2, "skip_special_tokens": False}
    assert text(api.ok(ep, spaces_between_special_tokens=False, **forced), ep) == text(api.ok(ep, **forced), ep)


def _cache_salt(api, ep):
    long = {"prompt": "paged attention " * 24} if ep == COMPLETIONS else {
        "messages": [{"role": "user", "content": "paged attention " * 24}]}
    api.ok(ep, max_tokens=1, cache_salt="walk-a", **long)
    assert api.ok(ep, max_tokens=1, cache_salt="walk-a", **long)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert not api.ok(ep, max_tokens=1, cache_salt="walk-b", **long)["usage"]["prompt_tokens_details"][
        "cached_tokens"]


def _request_id(api, ep):
    assert "walk-request" in api.ok(ep, request_id="walk-request")["id"]


def _kv_transfer_params(api, ep):
    """Honoured by a server with a KV connector (tests/entrypoints/test_pd_connector_server.py: a producer answers
    {"do_remote_decode": true} with where its blocks are, a consumer pulls them). This server has none: as vLLM,
    it ignores the field, and the response's kv_transfer_params is null."""
    response = api.ok(ep, kv_transfer_params={"do_remote_decode": True})
    assert response["kv_transfer_params"] is None
    assert response["choices"] == api.ok(ep)["choices"]


def _return_token_ids(api, ep):
    response = api.ok(ep, return_token_ids=True)
    assert len(token_ids(response)) == response["usage"]["completion_tokens"]
    prompt_ids = response["choices"][0]["prompt_token_ids"] if ep == COMPLETIONS else response["prompt_token_ids"]
    assert len(prompt_ids) == response["usage"]["prompt_tokens"]


def _return_tokens_as_token_ids(api, ep):
    logprobs = {"logprobs": 1} if ep == COMPLETIONS else {"logprobs": True, "top_logprobs": 1}
    response = api.ok(ep, return_token_ids=True, return_tokens_as_token_ids=True, **logprobs)
    tokens = response["choices"][0]["logprobs"]
    tokens = tokens["tokens"] if ep == COMPLETIONS else [entry["token"] for entry in tokens["content"]]
    assert tokens == [f"token_id:{i}" for i in token_ids(response)]


def _add_special_tokens(api, ep):
    with_bos = api.ok(ep, add_special_tokens=True)["usage"]["prompt_tokens"]
    assert with_bos == api.ok(ep, add_special_tokens=False)["usage"]["prompt_tokens"] + 1


def _prompt_logprobs(api, ep):
    response = api.ok(ep, prompt_logprobs=1)
    entries = response["choices"][0]["prompt_logprobs"] if ep == COMPLETIONS else response["prompt_logprobs"]
    assert len(entries) == response["usage"]["prompt_tokens"] and entries[0] is None and entries[1]


def _follows(check_text: Callable[[str], bool], **fields):
    def check(api, ep):
        response = api.ok(ep, max_tokens=24, **fields)
        assert check_text(text(response, ep)), text(response, ep)
    return check


def _json_prefix(text_: str) -> bool:
    return text_.startswith("{")


def _regex(text_: str) -> bool:
    return re.fullmatch(r"[a-c]{1,6}", text_) is not None


def _choice(text_: str) -> bool:
    return text_ in ("yes", "no")


def _guided_backend(api, ep):
    api.ok(ep, guided_regex="[a-c]{1,6}", guided_decoding_backend="guidance")
    api.refused(ep, "guided_decoding_backend", guided_regex="[a-c]{1,6}", guided_decoding_backend="xgrammar")


def _best_of(api, ep):
    api.ok(ep, best_of=1)
    api.refused(ep, "best_of", best_of=2)


def _prompt(api, ep):
    assert api.ok(ep, prompt="A much longer prompt than the base one")["usage"]["prompt_tokens"] > \
        api.ok(ep)["usage"]["prompt_tokens"]


def _max_tokens(name):
    def check(api, ep):
        assert api.ok(ep, ignore_eos=True, **{name: 3})["usage"]["completion_tokens"] == 3
    return check


def _max_completion_tokens(api, ep):
    assert api.ok(ep, ignore_eos=True, max_tokens=5, max_completion_tokens=3)["usage"]["completion_tokens"] == 3


def _completion_echo(api, ep):
    assert text(api.ok(ep, echo=True), ep).startswith(BASE[COMPLETIONS]["prompt"])


def _completion_logprobs(api, ep):
    assert api.ok(ep)["choices"][0]["logprobs"] is None
    logprobs = api.ok(ep, logprobs=2)["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 8 and all(logprobs["top_logprobs"])


def _messages(api, ep):
    longer = [{"role": "user", "content": "A much longer message than the base one"}]
    assert api.ok(ep, messages=longer)["usage"]["prompt_tokens"] > api.ok(ep)["usage"]["prompt_tokens"]


def _chat_logprobs(api, ep):
    assert len(api.ok(ep, logprobs=True)["choices"][0]["logprobs"]["content"]) == 8
    entries = api.ok(ep, logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]["content"]
    assert all(len(entry["top_logprobs"]) == 3 for entry in entries)


def _prompt_tokens_change(**fields):
    def check(api, ep):
        assert api.ok(ep, **fields)["usage"]["prompt_tokens"] != api.ok(ep)["usage"]["prompt_tokens"]
    return check


PREFILL = [{"role": "user", "content": "Hello world"}, {"role": "assistant", "content": "Once upon"}]


def _continue_final_message(api, ep):
    plain = api.ok(ep, messages=PREFILL, add_generation_prompt=False)["usage"]["prompt_tokens"]
    continued = api.ok(ep, messages=PREFILL, add_generation_prompt=False, continue_final_message=True)
    assert continued["usage"]["prompt_tokens"] < plain  # the final message left open: no <|im_end|>


def _chat_echo(api, ep):
    fields = {"messages": PREFILL, "add_generation_prompt": False, "continue_final_message": True}
    plain = text(api.ok(ep, **fields), ep)
    assert text(api.ok(ep, echo=True, **fields), ep) == "Once upon" + plain
    assert _streamed_text(api.chunks(ep, echo=True, **fields), ep) == "Once upon" + plain
    assert text(api.ok(ep, echo=True), ep) == text(api.ok(ep), ep)  # the last message is not the assistant's


def _chat_template(api, ep):
    assert api.ok(ep, chat_template="{{ messages[0]['content'] }}")["usage"]["prompt_tokens"] < \
        api.ok(ep)["usage"]["prompt_tokens"]


def _tool_calls(response: dict) -> list[dict]:
    return response["choices"][0]["message"].get("tool_calls") or []


def _tools(api, ep):
    assert api.ok(ep, tools=[TOOL], tool_choice="none")["usage"]["prompt_tokens"] > \
        api.ok(ep)["usage"]["prompt_tokens"]  # rendered by the template


def _tool_type(api, ep):
    api.ok(ep, tools=[TOOL], tool_choice="none")
    api.refused(ep, "tools", tools=[{**TOOL, "type": "retrieval"}])


def _tool_name(api, ep):
    calls = _tool_calls(api.ok(ep, tools=[TOOL], tool_choice=NAMED, max_tokens=40))
    assert [c["function"]["name"] for c in calls] == ["now"]


def _tool_parameters(api, ep):
    call = _tool_calls(api.ok(ep, tools=[TOOL], tool_choice=NAMED, max_tokens=40))[0]
    assert json.loads(call["function"]["arguments"])["tz"] in ("utc", "local")


def _tool_description(api, ep):
    other = {"type": "function", "function": {**TOOL["function"], "description": "A much longer description."}}
    assert api.ok(ep, tools=[other], tool_choice="none")["usage"]["prompt_tokens"] > \
        api.ok(ep, tools=[TOOL], tool_choice="none")["usage"]["prompt_tokens"]


def _tool_strict(api, ep):
    strict = {"type": "function", "function": {**TOOL["function"], "strict": True}}
    api.ok(ep, tools=[strict], tool_choice=NAMED, max_tokens=2)
    assert grammar(ep, tools=[strict], tool_choice=NAMED) != grammar(ep, tools=[TOOL], tool_choice=NAMED)


def _tool_choice(api, ep):
    assert not _tool_calls(api.ok(ep, tools=[TOOL], tool_choice="none"))
    assert _tool_calls(api.ok(ep, tools=[TOOL], tool_choice="required", max_tokens=60))


def _tool_choice_type(api, ep):
    api.refused(ep, "tool_choice", tools=[TOOL], tool_choice={"type": "retrieval", "function": {"name": "now"}})


def _tool_choice_name(api, ep):
    api.refused(ep, "tool_choice", tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}})
    _tool_name(api, ep)


def _parallel_tool_calls(api, ep):
    fields = {"tools": [TOOL], "tool_choice": "required"}
    api.ok(ep, parallel_tool_calls=False, max_tokens=2, **fields)
    assert '"maxItems":1' in grammar(ep, parallel_tool_calls=False, **fields).replace(" ", "")
    assert '"maxItems":1' not in grammar(ep, **fields).replace(" ", "")


def _response_format_type(api, ep):
    assert api.ok(ep, response_format={"type": "text"})["choices"] == api.ok(ep)["choices"]
    assert text(api.ok(ep, response_format={"type": "json_object"}), ep).startswith("{")
    api.refused(ep, "response_format", response_format={"type": "structural_tag"})


def _json_schema(**extra):
    return {"type": "json_schema", "json_schema": {"name": "walk", "schema": SCHEMA, **extra}}


SHARED: dict[str, Entry] = {
    "model": honoured(_model),
    "n": honoured(_n),
    "temperature": honoured(_temperature),
    "top_p": honoured(_equals_greedy(top_p=1e-6)),
    "top_k": honoured(_equals_greedy(top_k=1)),
    "min_p": honoured(_equals_greedy(min_p=1.0)),
    "presence_penalty": honoured(_penalty("presence_penalty")),
    "frequency_penalty": honoured(_penalty("frequency_penalty")),
    "repetition_penalty": honoured(_penalty("repetition_penalty")),
    "seed": honoured(_seed),
    "stop": honoured(_stop(include=False)),
    "include_stop_str_in_output": honoured(_stop(include=True)),
    "stream": honoured(_stream),
    "stream_options.include_usage": honoured(_include_usage),
    "stream_options.continuous_usage_stats": honoured(_continuous_usage),
    "logit_bias": honoured(_logit_bias),
    "user": no_effect("OpenAI's end-user id for abuse monitoring; vLLM accepts and ignores it too.", user="walk"),
    "ignore_eos": honoured(_ignore_eos),
    "min_tokens": honoured(_min_tokens),
    "stop_token_ids": honoured(_stop_token_ids),
    "skip_special_tokens": honoured(_skip_special_tokens),
    "spaces_between_special_tokens": Entry(
        "no_effect", _spaces_between_special_tokens,
        "Passed to the tokenizer's decode; a byte-level vocabulary never puts spaces between special tokens, so it "
        "changes nothing, as in vLLM's fast-tokenizer detokenizer."),
    "priority": refused("priority", priority=1),  # this server schedules fcfs (vLLM's check)
    # pagedllm's, honoured under --scheduling-policy slo only (tests/entrypoints/test_slo_server.py)
    "ttft_slo_ms": refused("ttft_slo_ms", ttft_slo_ms=1000),
    "tpot_slo_ms": refused("tpot_slo_ms", tpot_slo_ms=50),
    "cache_salt": honoured(_cache_salt),
    "request_id": honoured(_request_id),
    "kv_transfer_params": honoured(_kv_transfer_params),
    "return_token_ids": honoured(_return_token_ids),
    "return_tokens_as_token_ids": honoured(_return_tokens_as_token_ids),
    "add_special_tokens": honoured(_add_special_tokens),
    "prompt_logprobs": honoured(_prompt_logprobs),
    "structured_outputs.json": honoured(_follows(_json_prefix, structured_outputs={"json": SCHEMA})),
    "structured_outputs.regex": honoured(_follows(_regex, structured_outputs={"regex": "[a-c]{1,6}"})),
    "structured_outputs.choice": honoured(_follows(_choice, structured_outputs={"choice": ["yes", "no"]})),
    "structured_outputs.grammar": honoured(_follows(_choice, structured_outputs={"grammar": 'start: "yes" | "no"'})),
    "structured_outputs.json_object": honoured(_follows(_json_prefix, structured_outputs={"json_object": True})),
    "structured_outputs.disable_fallback": Entry(
        "no_effect", lambda api, ep: _same_choices(api, ep, {"choice": ["yes", "no"]}, disable_fallback=True),
        "vLLM's: no fallback to another backend; llguidance is the only one, so there is never a fallback."),
    "structured_outputs.disable_any_whitespace": grammar_changes(
        _base_structured_outputs={"json": SCHEMA}, structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}),
    "structured_outputs.disable_additional_properties": grammar_changes(
        _base_structured_outputs={"json": SCHEMA},
        structured_outputs={"json": SCHEMA, "disable_additional_properties": True}),
    "structured_outputs.whitespace_pattern": grammar_changes(
        _base_structured_outputs={"json": SCHEMA}, structured_outputs={"json": SCHEMA, "whitespace_pattern": " ?"}),
    "structured_outputs.structural_tag": refused("structured_outputs.structural_tag",
                                                 structured_outputs={"structural_tag": "{}"}),
    "response_format.type": honoured(_response_format_type),
    "response_format.json_schema.name": Entry(
        "no_effect", lambda api, ep: _same_response_format(api, ep, name="other"),
        "OpenAI's: names the format (required); it does not change the output."),
    "response_format.json_schema.description": Entry(
        "no_effect", lambda api, ep: _same_response_format(api, ep, description="What it is for."),
        "OpenAI's: says what the format is for; it does not change the output (vLLM does not use it either)."),
    "response_format.json_schema.schema": honoured(_follows(_json_prefix, response_format=_json_schema())),
    "response_format.json_schema.strict": grammar_changes(_base_response_format=_json_schema(strict=False),
                                                          response_format=_json_schema(strict=True)),
    "guided_json": honoured(_follows(_json_prefix, guided_json=SCHEMA)),
    "guided_regex": honoured(_follows(_regex, guided_regex="[a-c]{1,6}")),
    "guided_choice": honoured(_follows(_choice, guided_choice=["yes", "no"])),
    "guided_grammar": honoured(_follows(_choice, guided_grammar='start: "yes" | "no"')),
    "guided_json_object": honoured(_follows(_json_prefix, guided_json_object=True)),
    "guided_whitespace_pattern": grammar_changes(_base_guided_json=SCHEMA, guided_whitespace_pattern=" ?"),
    "guided_decoding_backend": honoured(_guided_backend),
    "structural_tag": refused("structural_tag", structural_tag="{}"),
}


def _same_choices(api, ep, constraint: dict, **options) -> None:
    with_option = api.ok(ep, structured_outputs={**constraint, **options})["choices"]
    assert with_option == api.ok(ep, structured_outputs=constraint)["choices"]


def _same_response_format(api, ep, **changes) -> None:
    changed = {"type": "json_schema", "json_schema": {**_json_schema()["json_schema"], **changes}}
    assert api.ok(ep, response_format=changed)["choices"] == api.ok(ep, response_format=_json_schema())["choices"]


ONLY: dict[str, dict[str, Entry]] = {
    COMPLETIONS: {
        "prompt": honoured(_prompt),
        "max_tokens": honoured(_max_tokens("max_tokens")),
        "echo": honoured(_completion_echo),
        "logprobs": honoured(_completion_logprobs),
        "suffix": refused("suffix", suffix="!"),
        "best_of": honoured(_best_of),
    },
    CHAT: {
        "messages": honoured(_messages),
        "max_tokens": honoured(_max_tokens("max_tokens")),
        "max_completion_tokens": honoured(_max_completion_tokens),
        "logprobs": honoured(_chat_logprobs),
        "top_logprobs": honoured(_chat_logprobs),
        "add_generation_prompt": honoured(_prompt_tokens_change(add_generation_prompt=False)),
        "continue_final_message": honoured(_continue_final_message),
        "echo": honoured(_chat_echo),
        "chat_template": honoured(_chat_template),
        "chat_template_kwargs": honoured(_prompt_tokens_change(chat_template_kwargs={"greeting": "Good morning"})),
        "tools[].type": honoured(_tool_type),
        "tools[].function.name": honoured(_tool_name),
        "tools[].function.description": honoured(_tool_description),
        "tools[].function.parameters": honoured(_tool_parameters),
        "tools[].function.strict": honoured(_tool_strict),
        "tool_choice": honoured(_tool_choice),
        "tool_choice.type": honoured(_tool_choice_type),
        "tool_choice.function.name": honoured(_tool_choice_name),
        "parallel_tool_calls": honoured(_parallel_tool_calls),
    },
}
FIELDS: dict[tuple[str, str], Entry] = {(ep, path): entry for ep in (COMPLETIONS, CHAT)
                                        for path, entry in {**SHARED, **ONLY[ep]}.items()}
NO_EFFECT_ALLOWED = {"user", "spaces_between_special_tokens", "structured_outputs.disable_fallback",
                     "response_format.json_schema.name", "response_format.json_schema.description"}
"""The only fields documented to change nothing; another no_effect entry fails the walk."""


def _leaves(model) -> set[str]:
    """Declared fields that are values, not only containers: a container (stream_options, tools, ...) is honoured
    through its fields; one that may also be a value (tool_choice: "required" or an object) has its own entry."""
    paths = set(declared_fields(model))
    return {p for p in paths if not any(q.startswith((p + ".", p + "[].")) for q in paths)}


def test_every_declared_field_has_an_entry():
    for endpoint, model in MODELS.items():
        listed = {path for ep, path in FIELDS if ep == endpoint}
        assert _leaves(model) - listed == set(), f"{model.__name__}: fields without an entry"
        assert listed - set(declared_fields(model)) == set(), f"{model.__name__}: entries for undeclared fields"
    no_effect_paths = {path for (_, path), entry in FIELDS.items() if entry.kind == "no_effect"}
    assert no_effect_paths <= NO_EFFECT_ALLOWED
    assert all(entry.reason for entry in FIELDS.values() if entry.kind == "no_effect")


# ---- the walk ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api(tiny_llama_dir, tmp_path_factory):
    """The server: the tiny model whose tokenizer adds BOS, TEMPLATE, trusted request templates, hermes."""
    folder = tmp_path_factory.mktemp("walk-model")
    shutil.copytree(tiny_llama_dir, folder, dirs_exist_ok=True)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [BOS], "tokens": ["<|im_start|>"]}}}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    template = Path(folder) / "walk.jinja"
    template.write_text(TEMPLATE)
    server = RemoteServer(folder, "--chat-template", str(template), "--trust-request-chat-template",
                          "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-num-seqs", "8",
                          "--enable-prompt-tokens-details")
    yield Api(server)
    server.close()


@pytest.mark.slow
@pytest.mark.parametrize("endpoint, path", sorted(FIELDS), ids=[f"{ep}:{path}" for ep, path in sorted(FIELDS)])
def test_field(api, endpoint, path):
    FIELDS[(endpoint, path)].check(api, endpoint)
