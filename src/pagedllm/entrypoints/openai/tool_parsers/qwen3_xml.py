"""The `qwen3_xml` tool call parser (`--tool-call-parser qwen3_xml`, or `qwen3_coder`): Qwen3-Coder's XML calls,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Text before the first `<tool_call>` (or `<function=`) is the message's content; text after the calls is
dropped. A parameter's value loses one leading and one trailing newline and is converted by the type its tool's
schema gives it, as vLLM's parser does: strings stay text, integers and numbers are parsed, booleans are
`true`/`false`, objects and arrays are read as JSON (text where they are not JSON), `null` is null, and a
parameter the schema does not name stays text. The arguments are the JSON object of the parameters in order; a
stream sends `{`, then each parameter once it has closed, then `}` once the function has, so the pieces add up to
the non-streamed arguments exactly.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.partial_calls import PartialCall, partial_marker_len

STARTS = ("<tool_call>", "<function=")
_FUNCTION = re.compile(r"<function=([^>]*)>(.*?)(</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>]*)>(.*?)(</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")


def extract_tool_calls(text: str, tools=None) -> tuple[str | None, list[tuple[str, str]]] | None:
    """(content, [(name, arguments JSON)]) of a finished output; None when it has no call (plain content)."""
    content, calls = _parse(text, True, tools)
    if content is None or not calls:
        return None
    return content or None, [(call.name, call.arguments) for call in calls]


def stream_state(text: str, finished: bool, tools=None) -> tuple[str, list[PartialCall]]:
    """(content that may be sent so far, calls so far) of a growing output: the content stops before the first
    call, and before a tail that may still become one while the output is unfinished."""
    content, calls = _parse(text, finished, tools)
    if content is None:
        return (text if finished else text[:len(text) - partial_marker_len(text, *STARTS)]), []
    return content, calls


def _parse(text: str, finished: bool, tools) -> tuple[str | None, list[PartialCall]]:
    """(content before the first call, or None: no call begins; the calls whose name has closed)."""
    starts = [i for i in (text.find(marker) for marker in STARTS) if i >= 0]
    if not starts:
        return None, []
    start = min(starts)
    calls = []
    for match in _FUNCTION.finditer(text, start):
        name, body, end = match.group(1).strip(), match.group(2), match.group(3)
        if not name:
            continue
        closed = bool(end) or finished
        if not closed:
            body = body[:len(body) - partial_marker_len(body, "</function>")]
        schema = _properties(tools, name)
        pieces = []
        for param in _PARAMETER.finditer(body):
            if not (param.group(3) or param.end() < len(body) or closed):
                break  # the value may still grow
            key, value = param.group(1).strip(), _strip_newline(param.group(2))
            pieces.append(f"{json.dumps(key, ensure_ascii=False)}: "
                          f"{json.dumps(_convert(value, schema.get(key)), ensure_ascii=False)}")
        calls.append(PartialCall(name=name, arguments="{" + ", ".join(pieces) + ("}" if closed else ""),
                                 complete=closed))
    return text[:start], calls


def _strip_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _properties(tools, name: str) -> dict[str, Any]:
    """The `properties` of the tool `name`'s parameters schema ({} for an unknown tool)."""
    for tool in tools or ():
        if tool.function.name == name and isinstance(tool.function.parameters, dict):
            properties = tool.function.parameters.get("properties")
            return properties if isinstance(properties, dict) else {}
    return {}


def _convert(value: str, schema: Any) -> Any:
    """A parameter's text as the value its schema's type asks for (the text itself where it does not parse)."""
    if value.lower() == "null":
        return None
    kind = schema.get("type") if isinstance(schema, dict) else None
    if not isinstance(kind, str):
        return value
    kind = kind.strip().lower()
    if kind in _STRING_TYPES:
        return value
    try:
        if kind.startswith(_INT_PREFIXES):
            return int(value)
        if kind.startswith(("num", "float")):
            number = float(value)
            if not math.isfinite(number):
                return value
            return int(number) if number.is_integer() else number
    except ValueError:
        return value
    if kind in ("boolean", "bool", "binary"):
        return value.strip().lower() == "true"
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return value
