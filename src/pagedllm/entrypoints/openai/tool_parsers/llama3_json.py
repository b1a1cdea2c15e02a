"""The `llama3_json` tool call parser (`--tool-call-parser llama3_json`, or `llama4_json`): calls are JSON objects
`{"name": ..., "parameters": {...}}` (or `"arguments"`), several separated by `;`, as vLLM's Llama 3 and 4 JSON
templates ask for.

The calls begin at `<|python_tag|>` (text before it is the message's content), or, without that token, when the
output itself begins with `{` (leading whitespace aside): the output is then calls only (content None, as vLLM
returns it). Text after the last call object is dropped. An output whose calls do not parse, or whose objects
lack a string `name`, is plain content.
"""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.partial_calls import PartialCall, partial_marker_len, scan_calls

BOT_TOKEN = "<|python_tag|>"
ARGUMENT_KEYS = ("arguments", "parameters")


def _calls_start(text: str) -> tuple[int, int] | None:
    """(end of the content, start of the calls) in `text`; None: no call begins (yet)."""
    tag = text.find(BOT_TOKEN)
    if tag >= 0:
        return tag, tag + len(BOT_TOKEN)
    stripped = text.lstrip()
    if stripped.startswith("{"):
        return 0, len(text) - len(stripped)
    return None


def extract_tool_calls(text: str, tools=None) -> tuple[str | None, list[tuple[str, str]]] | None:
    """(content, [(name, arguments JSON)]) of a finished output; None when it has no call (plain content)."""
    found = _calls_start(text)
    if found is None:
        return None
    content_end, pos = found
    decoder = json.JSONDecoder()
    calls = []
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if pos >= len(text) or text[pos] != "{":
            break
        try:
            call, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            return None
        arguments = call["arguments"] if "arguments" in call else call.get("parameters", {})
        calls.append((call["name"], json.dumps(arguments, ensure_ascii=False)))
    if not calls:
        return None
    return text[:content_end] or None, calls


def stream_state(text: str, finished: bool, tools=None) -> tuple[str, list[PartialCall]]:
    """(content that may be sent so far, calls so far) of a growing output. While unfinished, content holds back
    a tail that may still become `<|python_tag|>`, and an output of whitespace only (a call may follow)."""
    found = _calls_start(text)
    if found is None:
        if finished:
            return text, []
        if not text.strip():
            return "", []
        return text[:len(text) - partial_marker_len(text, BOT_TOKEN)], []
    content_end, start = found
    return text[:content_end], scan_calls(text[start:], ARGUMENT_KEYS, in_array=False)
