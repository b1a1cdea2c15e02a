"""The `hermes` tool call parser (`--tool-call-parser hermes`): calls are JSON objects in
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, as Hermes-style templates ask for.

Text before the first block is the message's content; text after it is dropped, as vLLM's hermes parser does.
"""

from __future__ import annotations

import json
import re

from pagedllm.entrypoints.openai.tool_parsers.partial_calls import PartialCall, partial_marker_len, scan_calls

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def extract_tool_calls(text: str, tools=None) -> tuple[str | None, list[tuple[str, str]]] | None:
    """(content, [(name, arguments JSON)]) of a finished output; None when it has no call or a block that is
    not a JSON object with a string name (the output is then plain content)."""
    if TOOL_CALL_START not in text:
        return None
    calls = []
    for closed, unclosed in _BLOCK.findall(text):
        try:
            call = json.loads(closed or unclosed)
        except ValueError:
            return None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            return None
        calls.append((call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)))
    content = text[:text.index(TOOL_CALL_START)]
    return content or None, calls


def stream_state(text: str, finished: bool, tools=None) -> tuple[str, list[PartialCall]]:
    """(content that may be sent so far, calls so far) of a growing output: the content stops before the first
    block, and before a tail that may still become `<tool_call>` while the output is unfinished."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return (text if finished else text[:len(text) - partial_marker_len(text, TOOL_CALL_START)]), []
    calls = []
    for block in text[start:].split(TOOL_CALL_START)[1:]:
        found = scan_calls(block.split(TOOL_CALL_END, 1)[0], "arguments", in_array=False)
        if found:
            calls.append(found[0])
    return text[:start], calls

