"""`tool_choice: "required"` and a named function with the real SmolLM2, a real `pagedllm serve` and the openai
client: every response carries `tool_calls` (never the call's JSON in `content`), streamed or not, with and without
parallel_tool_calls, at temperature 0 and 0.7, over tools whose parameters are open objects (no
additionalProperties), nested, strict, or absent.

A call of a message that finished with `tool_calls` parses and validates against its tool's `parameters`; one cut
by max_tokens (`length`) keeps the calls begun, all complete but the last, whose arguments are a JSON prefix. On
9c0cf5c the open objects let the model add keys until max_tokens, and the cut `required` output came back as
`content` with no `tool_calls`."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from json_checks import is_json_prefix, undeclared_keys
from server_utils import MODEL_NAME

pytestmark = pytest.mark.slow

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web.", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 60}, "filters": {
            "type": "object", "properties": {"site": {"type": "string"}, "year": {"type": "integer"}}}},
        "required": ["query"]}}},
    {"type": "function", "function": {"name": "create_event", "description": "Add a calendar event.", "strict": True,
                                      "parameters": {
        "type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                         "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                                         "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": ["title", "date", "attendees"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The current time (no arguments)."}},
]
PROMPTS = ["What's the weather in Paris?", "Find articles about paged attention from 2023.",
           "Put lunch with Ana on my calendar for 2025-03-14.", "What time is it?"]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


def _body(index: int, mode: str, parallel: bool, temperature: float) -> dict:
    name = TOOLS[index]["function"]["name"]
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPTS[index]}], "tools": TOOLS,
            "tool_choice": "required" if mode == "required" else {"type": "function", "function": {"name": name}},
            "parallel_tool_calls": parallel, "temperature": temperature, "seed": index, "max_tokens": MAX_TOKENS}


def _whole(client, body: dict) -> tuple[str | None, list[tuple[str, str]], str]:
    choice = client.chat.completions.create(**body).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in choice.message.tool_calls or [])
    return choice.message.content, calls, choice.finish_reason


def _streamed(client, body: dict) -> tuple[str | None, list[tuple[str, str]], str]:
    """The message reassembled from the raw chunks as the SDK does: by call index, name from the first delta,
    argument fragments appended."""
    content, calls, finish_reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                name, arguments = calls.get(delta.index, (None, ""))
                calls[delta.index] = (name or delta.function.name, arguments + (delta.function.arguments or ""))
            finish_reason = choice.finish_reason or finish_reason
    return content, [calls[i] for i in sorted(calls)], finish_reason


def _problems(mode: str, index: int, parallel: bool, content, calls, finish_reason) -> list[str]:
    problems = [f"content {content[:80]!r}"] if content else []
    if not calls:
        return [*problems, f"no tool_calls ({finish_reason})"]
    if finish_reason not in ("tool_calls", "length"):
        problems.append(f"finish_reason {finish_reason}")
    if not parallel and len(calls) > 1:
        problems.append(f"{len(calls)} calls with parallel_tool_calls false")
    tools = {t["function"]["name"]: t["function"] for t in TOOLS}
    for number, (name, arguments) in enumerate(calls):
        if name not in tools or (mode == "named" and name != TOOLS[index]["function"]["name"]):
            problems.append(f"call of {name!r}")
            continue
        if finish_reason == "length" and number == len(calls) - 1:
            if not is_json_prefix(arguments):
                problems.append(f"cut arguments not a JSON prefix: {arguments[:80]!r}")
            continue
        parameters = tools[name].get("parameters") or {"type": "object", "properties": {}}
        try:
            value = json.loads(arguments)
            jsonschema.validate(value, parameters)
        except (ValueError, jsonschema.ValidationError) as e:
            problems.append(f"{name} arguments {arguments[:80]!r}: {e}")
            continue
        if undeclared_keys(value, parameters):
            problems.append(f"{name} arguments with keys the schema does not name: {arguments[:80]!r}")
    return problems


def test_required_and_named_always_yield_valid_tool_calls(server):
    client = server.client(timeout=600)
    jobs = [(mode, index, parallel, temperature, stream) for mode in ("required", "named") for index in range(4)
            for parallel in (True, False) for temperature, stream in ((0.0, False), (0.0, True), (0.7, True))]

    def run(job):
        mode, index, parallel, temperature, stream = job
        return (_streamed if stream else _whole)(client, _body(index, mode, parallel, temperature))

    with ThreadPoolExecutor(32) as pool:
        results = dict(zip(jobs, pool.map(run, jobs), strict=True))
    bad = {job: (problems, result[1][:2]) for job, result in results.items()
           if (problems := _problems(*job[:3], *result))}
    assert not bad
    for (mode, index, parallel, temperature, stream), (_, calls, reason) in results.items():
        if stream and temperature == 0.0:  # greedy: the stream carries the calls of the whole response
            _, whole_calls, whole_reason = results[(mode, index, parallel, temperature, False)]
            assert reason == whole_reason
            assert _comparable(calls, reason) == _comparable(whole_calls, whole_reason)
    finished = sum(result[2] == "tool_calls" for result in results.values())
    assert finished >= 3 * len(results) // 4, "most messages end with their calls"


def _comparable(calls: list[tuple[str, str]], finish_reason: str) -> list:
    """Calls with their arguments parsed (a finished message) or as text (cut: the last one does not parse)."""
    return [(name, arguments if finish_reason == "length" else json.loads(arguments)) for name, arguments in calls]
