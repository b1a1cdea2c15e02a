"""Response shapes of structured-output and tool-calling requests, side by side (issue 14's vLLM comparison).

Sends the same requests to each server given (response_format json_schema and json_object, structured_outputs
regex/choice on completions, tool_choice required and named; each streamed and not) and prints, per request, the
shape of the answer: the key tree with value types (not the values), `finish_reason`, and for streams the run of
chunk shapes (consecutive equal shapes folded into one with a count). Differences between the servers are listed
at the end.

    python benchmarks/structured_outputs_shapes.py --server vllm=http://127.0.0.1:8000 \\
        --server pagedllm=http://127.0.0.1:8001 [--output shapes.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import httpx

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": SCHEMA}}]
ASK = [{"role": "user", "content": "Plan a short trip: which city, and for how many days?"}]
CASES = {
    "chat json_schema": ("chat", {"messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}}),
    "chat json_object": ("chat", {"messages": ASK, "response_format": {"type": "json_object"}}),
    "completions regex": ("completions", {"prompt": "Order number:", "structured_outputs": {
        "regex": "[A-Z]{2}-[0-9]{4}"}}),
    "chat choice": ("chat", {"messages": ASK, "structured_outputs": {"choice": ["Paris", "Rome", "Oslo"]}}),
    "tools required": ("chat", {"messages": ASK, "tools": TOOLS, "tool_choice": "required"}),
    "tools named": ("chat", {"messages": ASK, "tools": TOOLS,
                             "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
}


def shape(value):
    """The value's structure: dicts by key (sorted), lists by their first item's shape, scalars by type."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def finish_reasons(body: dict) -> list:
    return [c.get("finish_reason") for c in body.get("choices", [])]


def run_case(client: httpx.Client, base: str, model: str, kind: str, body: dict, stream: bool) -> dict:
    payload = {"model": model, "max_tokens": 96, "temperature": 0, **body, "stream": stream}
    url = f"{base}/v1/{'chat/completions' if kind == 'chat' else 'completions'}"
    if not stream:
        r = client.post(url, json=payload)
        out = r.json()
        return {"status": r.status_code, "shape": shape(out), "finish_reason": finish_reasons(out),
                "example": out.get("choices", [{}])[0] if r.status_code == 200 else out}
    chunks, reasons = [], []
    with client.stream("POST", url, json=payload) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "error": r.read().decode()}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            s = json.dumps(shape(chunk), sort_keys=True)
            if chunks and chunks[-1][0] == s:
                chunks[-1][1] += 1
            else:
                chunks.append([s, 1])
            reasons += [x for x in finish_reasons(chunk) if x]
    return {"status": 200, "chunks": [{"shape": json.loads(s), "count": n} for s, n in chunks],
            "finish_reason": reasons}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", action="append", required=True, help="NAME=BASE_URL (repeat)")
    parser.add_argument("--output", help="write every shape here as JSON")
    args = parser.parse_args()
    results: dict[str, dict] = {}
    with httpx.Client(timeout=600) as client:
        for spec in args.server:
            name, base = spec.split("=", 1)
            model = client.get(f"{base}/v1/models").json()["data"][0]["id"]
            results[name] = {f"{case} stream={stream}": run_case(client, base, model, kind, body, stream)
                             for case, (kind, body) in CASES.items() for stream in (False, True)}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
    names = list(results)
    for case in results[names[0]]:
        views = {n: {k: v for k, v in results[n][case].items() if k != "example"} for n in names}
        same = all(views[n] == views[names[0]] for n in names)
        print(f"{case}: {'same shape' if same else 'DIFFERENT'}")
        for n in names:
            r = results[n][case]
            print(f"  {n}: status {r['status']}, finish_reason {r.get('finish_reason')}"
                  + ("" if same else f"\n    {json.dumps(views[n], sort_keys=True)[:1500]}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
