"""Validity of enforced tool calls: `tool_choice: "required"` and a named function over 5 tools, greedy and at
temperature 1, against a running server. A request counts as valid when its message has at least one tool call,
every call names a tool of the request (the chosen one, for a named choice), and its arguments parse as JSON and
validate against that tool's `parameters` schema (jsonschema_rs, the validator installed with the test extras).

Run (SmolLM2, the shipped Hermes template):
    .venv/bin/pagedllm serve --chat-template tool_chat_template_hermes.jinja --max-num-seqs 16 &
    .venv/bin/python benchmarks/tool_calling_validity.py --requests-per-tool 20 --output results/tool_validity.json

Prints one row per (mode, temperature): valid / total, finish reasons, completion tokens, wall time; exits 1 if
any request was invalid. tests/entrypoints/test_tool_calling_server.py runs it at CI size on the tiny model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema_rs
import openai


def _function(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


TOOLS = [
    _function("get_weather", "The current weather in a city.",
              {"city": {"type": "string", "minLength": 1, "maxLength": 40},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city", "unit"]),
    _function("search_web", "Search the web.",
              {"query": {"type": "string", "minLength": 1, "maxLength": 60},
               "max_results": {"type": "integer", "minimum": 1, "maximum": 10}}, ["query"]),
    _function("create_event", "Add an event to the calendar.",
              {"title": {"type": "string", "minLength": 1, "maxLength": 40},
               "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
               "attendees": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3}},
              ["title", "date"]),
    _function("set_thermostat", "Set the thermostat.",
              {"temperature": {"type": "number", "minimum": 10, "maximum": 30},
               "mode": {"type": "string", "enum": ["heat", "cool", "auto"]}}, ["temperature", "mode"]),
    _function("send_email", "Send an email.",
              {"to": {"type": "string", "maxLength": 40}, "subject": {"type": "string", "maxLength": 60},
               "urgent": {"type": "boolean"}}, ["to", "subject", "urgent"]),
]
PROMPTS = [
    "What's the weather like in Paris right now?",
    "Find me recent articles about paged attention.",
    "Put a team lunch with Ana and Bo on my calendar for 2025-03-14.",
    "It's too cold in here, warm the house up to 22 degrees.",
    "Email bob@example.com that the report is late, mark it urgent.",
]
VALIDATORS = {tool["function"]["name"]: jsonschema_rs.validator_for(tool["function"]["parameters"]) for tool in TOOLS}


def check(message, chosen: str | None) -> str | None:
    """None if the message's tool calls are valid, else why not."""
    if not message.tool_calls:
        return "no tool_calls"
    for call in message.tool_calls:
        name = call.function.name
        if name not in VALIDATORS or (chosen is not None and name != chosen):
            return f"wrong name {name!r}"
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            return f"arguments not JSON: {call.function.arguments[:80]!r}"
        if not VALIDATORS[name].is_valid(arguments):
            return f"arguments not valid for {name}: {call.function.arguments[:80]!r}"
    return None


def one_request(client: openai.OpenAI, model: str, tool_index: int, mode: str, temperature: float,
                max_tokens: int, seed: int, parallel_tool_calls: bool) -> dict[str, Any]:
    chosen = TOOLS[tool_index]["function"]["name"] if mode == "named" else None
    tool_choice = {"type": "function", "function": {"name": chosen}} if chosen else "required"
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[tool_index]}], tools=TOOLS,
        tool_choice=tool_choice, temperature=temperature, max_tokens=max_tokens, seed=seed,
        parallel_tool_calls=parallel_tool_calls)
    choice = response.choices[0]
    return {"mode": mode, "temperature": temperature, "tool": tool_index, "error": check(choice.message, chosen),
            "finish_reason": choice.finish_reason, "completion_tokens": response.usage.completion_tokens,
            "num_calls": len(choice.message.tool_calls or [])}


def run_validity(base_url: str, requests_per_tool: int, temperatures=(0.0, 1.0), modes=("required", "named"),
                 concurrency: int = 16, max_tokens: int = 512, parallel_tool_calls: bool = True,
                 api_key: str = "unused", seed_offset: int = 0) -> list[dict[str, Any]]:
    """One row per (mode, temperature): total, valid, errors (the first few), finish reasons, tokens, seconds.
    parallel_tool_calls=False caps `required` at one call (maxItems 1)."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    rows = []
    for mode in modes:
        for temperature in temperatures:
            jobs = [(tool, mode, temperature, max_tokens, 1000 * tool + seed_offset + i, parallel_tool_calls)
                    for tool in range(len(TOOLS)) for i in range(requests_per_tool)]
            start = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                results = list(pool.map(lambda job: one_request(client, model, *job), jobs))
            seconds = time.perf_counter() - start
            errors = [r["error"] for r in results if r["error"] is not None]
            rows.append({"mode": mode, "temperature": temperature, "total": len(results),
                         "valid": len(results) - len(errors), "errors": errors[:5],
                         "finish_reasons": dict(Counter(r["finish_reason"] for r in results)),
                         "calls_per_response": dict(Counter(r["num_calls"] for r in results)),
                         "mean_completion_tokens": sum(r["completion_tokens"] for r in results) / len(results),
                         "seconds": round(seconds, 1)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--requests-per-tool", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--no-parallel-tool-calls", action="store_true",
                        help="send parallel_tool_calls: false (required: exactly one call)")
    parser.add_argument("--seed-offset", type=int, default=0, help="request i of a tool has seed 1000 * tool + "
                        "offset + i (another offset: other samples at temperature 1)")
    parser.add_argument("--output", help="write the rows as JSON here")
    args = parser.parse_args()
    rows = run_validity(args.base_url, args.requests_per_tool, concurrency=args.concurrency,
                        max_tokens=args.max_tokens, parallel_tool_calls=not args.no_parallel_tool_calls,
                        seed_offset=args.seed_offset)
    print(f"{'mode':<9} {'temp':>4} {'valid':>9} {'tokens':>7} {'s':>6}  finish reasons / calls per response")
    for row in rows:
        print(f"{row['mode']:<9} {row['temperature']:>4} {row['valid']:>4}/{row['total']:<4} "
              f"{row['mean_completion_tokens']:>7.1f} {row['seconds']:>6}  {row['finish_reasons']} "
              f"{row['calls_per_response']}")
        for error in row["errors"]:
            print(f"    {error}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(row["valid"] == row["total"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
