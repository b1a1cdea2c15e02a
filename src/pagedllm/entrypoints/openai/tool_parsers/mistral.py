"""The `mistral` tool call parser (`--tool-call-parser mistral`): the calls are a JSON array
`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after the `[TOOL_CALLS]` token, as Mistral 7B Instruct v0.3
and vLLM's Mistral template write them (the array format vLLM reads with a Hugging Face tokenizer).

`[TOOL_CALLS]` is a special token: with this parser an auto tool choice request keeps special tokens in the output
(`SKIP_SPECIAL_TOKENS`), as vLLM's parser asks. Text before it is the message's content; text after the array is
dropped. An array that does not parse, or an item without a string `name`, leaves the output plain content.
"""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.partial_calls import PartialCall, partial_marker_len, scan_calls

BOT_TOKEN = "[TOOL_CALLS]"
SKIP_SPECIAL_TOKENS = False
"""The tool call token must reach the parser (the request's skip_special_tokens is set false)."""


def extract_tool_calls(text: str, tools=None) -> tuple[str | None, list[tuple[str, str]]] | None:
    """(content, [(name, arguments JSON)]) of a finished output; None when it has no call (plain content)."""
    start = text.find(BOT_TOKEN)
    if start < 0:
        return None
    rest = text[start + len(BOT_TOKEN):].lstrip()
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
    return text[:start], scan_calls(text[start + len(BOT_TOKEN):], "arguments", in_array=True)
