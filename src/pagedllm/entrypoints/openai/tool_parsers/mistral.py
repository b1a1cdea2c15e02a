"""The `mistral` tool call parser (`--tool-call-parser mistral`), for the two formats vLLM's parser reads:

- before tokenizer v11 (Mistral 7B Instruct v0.3, vLLM's Mistral template): one JSON array after the token,
  `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- v11 and later (Mistral Small 3.2, Magistral, Devstral): each call its own `[TOOL_CALLS]NAME{...}` or
  `[TOOL_CALLS]NAME[ARGS]{...}`, the arguments a JSON object.

vLLM picks the format from the tokenizer; here the text after the first `[TOOL_CALLS]` does (`[` opens the array).

`[TOOL_CALLS]` is a special token: with this parser an auto tool choice request keeps special tokens in the output
(`SKIP_SPECIAL_TOKENS`), as vLLM's parser asks. Text before it is the message's content; text after the array
(or after a call's arguments) is dropped. An array that does not parse, an item without a string `name`, or a v11
call without a name or whose arguments are not a JSON object leaves the output plain content.
"""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.partial_calls import PartialCall, partial_marker_len, scan_calls

BOT_TOKEN = "[TOOL_CALLS]"
ARGS_TOKEN = "[ARGS]"
SKIP_SPECIAL_TOKENS = False
"""The tool call token must reach the parser (the request's skip_special_tokens is set false)."""


def extract_tool_calls(text: str, tools=None) -> tuple[str | None, list[tuple[str, str]]] | None:
    """(content, [(name, arguments JSON)]) of a finished output; None when it has no call (plain content)."""
    start = text.find(BOT_TOKEN)
    if start < 0:
        return None
    rest = text[start + len(BOT_TOKEN):].lstrip()
    if not rest.startswith("["):
        return _extract_v11(text[:start], text[start:])
    try:
        array, _ = json.JSONDecoder().raw_decode(rest)
    except ValueError:
        return None
    if not (isinstance(array, list) and array and all(
            isinstance(call, dict) and isinstance(call.get("name"), str) for call in array)):
        return None
    calls = [(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)) for call in array]
    return text[:start] or None, calls


def stream_state(text: str, finished: bool, tools=None) -> tuple[str, list[PartialCall]]:
    """(content that may be sent so far, calls so far) of a growing output: the content stops at `[TOOL_CALLS]`,
    and before a tail that may still become it while the output is unfinished."""
    start = text.find(BOT_TOKEN)
    if start < 0:
        return (text if finished else text[:len(text) - partial_marker_len(text, BOT_TOKEN)]), []
    rest = text[start + len(BOT_TOKEN):]
    if rest.lstrip().startswith("[") or not rest.strip():
        return text[:start], scan_calls(rest, "arguments", in_array=True)
    calls = []
    for segment in text[start:].split(BOT_TOKEN)[1:]:
        name, brace = _name(segment)
        if not name:
            break  # the name is still growing (or is not a name)
        value = segment[brace:].strip()
        arguments = _json_prefix(value)
        calls.append(PartialCall(name=name, arguments=arguments, complete=len(arguments) < len(value) or finished))
    return text[:start], calls


def _extract_v11(content: str, calls_text: str) -> tuple[str | None, list[tuple[str, str]]] | None:
    calls = []
    for segment in calls_text.split(BOT_TOKEN)[1:]:
        name, brace = _name(segment)
        if not name:
            return None
        try:
            arguments, _ = json.JSONDecoder().raw_decode(segment[brace:].lstrip())
        except ValueError:
            return None
        if not isinstance(arguments, dict):
            return None
        calls.append((name, json.dumps(arguments, ensure_ascii=False)))
    return content or None, calls


def _name(segment: str) -> tuple[str | None, int]:
    """(the call's name, where its arguments begin) in a `NAME{...}` or `NAME[ARGS]{...}` segment; (None, -1) while
    the arguments have not begun."""
    brace = segment.find("{")
    args = segment.find(ARGS_TOKEN)
    if args >= 0 and (brace < 0 or args < brace):
        return segment[:args].strip(), args + len(ARGS_TOKEN)
    if brace < 0:
        return None, -1
    return segment[:brace].strip(), brace


def _json_prefix(text: str) -> str:
    """`text` up to the end of its first JSON value (all of it, trailing whitespace aside, while it is open)."""
    depth, in_string, escape = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return text[:i + 1]
    return text.rstrip()
