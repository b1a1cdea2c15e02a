"""Checks of constrained JSON output, independent of the grammar backend: whether a text is a prefix of some JSON
text (an output cut by max_tokens), where it has whitespace outside strings, and whether its objects hold keys
their schema does not name."""

from __future__ import annotations

import re
from typing import Any

_NUMBER_PREFIX = re.compile(r"-?(0|[1-9][0-9]*)?(\.[0-9]*)?([eE][+-]?[0-9]*)?")
_LITERALS = ("true", "false", "null")


def is_json_prefix(text: str) -> bool:
    """Whether `text` can be continued into one valid JSON text (RFC 8259; leading and trailing whitespace
    allowed). A pushdown scan: `stack` holds the open containers, `expect` what may come next."""
    stack: list[str] = []
    expect = "value"  # value, key, colon, comma_or_close, end; "first_*" after an opening bracket
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in " \t\r\n":
            i += 1
            continue
        if expect in ("value", "first_value"):
            if expect == "first_value" and ch == "]":
                stack.pop()
                expect, i = _after_value(stack), i + 1
                continue
            if ch in "{[":
                stack.append(ch)
                expect, i = ("first_key" if ch == "{" else "first_value"), i + 1
            elif ch == '"':
                end, ok = _scan_string(text, i)
                if end is None:
                    return ok
                expect, i = _after_value(stack), end
            elif ch == "-" or ch.isdigit():
                end = _NUMBER_PREFIX.match(text, i).end()
                if end == n:
                    return True
                if not re.fullmatch(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?", text[i:end]):
                    return False
                expect, i = _after_value(stack), end
            else:
                word = next((w for w in _LITERALS if text.startswith(w, i) or w.startswith(text[i:])), None)
                if word is None:
                    return False
                if not text.startswith(word, i):
                    return True  # a literal cut short at the end
                expect, i = _after_value(stack), i + len(word)
        elif expect in ("key", "first_key"):
            if expect == "first_key" and ch == "}":
                stack.pop()
                expect, i = _after_value(stack), i + 1
                continue
            if ch != '"':
                return False
            end, ok = _scan_string(text, i)
            if end is None:
                return ok
            expect, i = "colon", end
        elif expect == "colon":
            if ch != ":":
                return False
            expect, i = "value", i + 1
        elif expect == "comma_or_close":
            if ch == ",":
                expect = "key" if stack[-1] == "{" else "value"
            elif ch == ("}" if stack[-1] == "{" else "]"):
                stack.pop()
                expect = _after_value(stack)
            else:
                return False
            i += 1
        else:  # end: only whitespace may follow a complete value
            return False
    return True


def _after_value(stack: list[str]) -> str:
    return "comma_or_close" if stack else "end"


def _scan_string(text: str, start: int) -> tuple[int | None, bool]:
    """The string literal that begins at `start`: (the index after its closing quote, True), or (None, True) when
    `text` ends inside it and it is well formed so far, or (None, False) for a raw control character or a bad
    escape."""
    i = start + 1
    while i < len(text):
        ch = text[i]
        if ch == '"':
            return i + 1, True
        if ord(ch) < 0x20:
            return None, False
        if ch == "\\":
            escape = text[i + 1:i + 2]
            if escape == "u":
                digits = text[i + 2:i + 6]
                if not re.fullmatch(r"[0-9a-fA-F]*", digits):
                    return None, False
                i += 6
            elif escape and escape not in '"\\/bfnrt':
                return None, False
            else:
                i += 2
        else:
            i += 1
    return None, True


def free_whitespace(text: str) -> list[str]:
    """The whitespace runs outside strings that are not the single space after a separator `,` or `:` (compact
    JSON with json.dumps's separators has none)."""
    found = []
    outside = re.sub(r'"(?:[^"\\]|\\.)*"?', '""', text)  # strings (the last perhaps unclosed) emptied
    for match in re.finditer(r"\s+", outside):
        before = outside[match.start() - 1] if match.start() else ""
        if not (match.group() == " " and before in ",:"):
            found.append(match.group())
    return found


def undeclared_keys(value: Any, schema: Any, defs: dict | None = None) -> list[str]:
    """Keys of `value`'s objects that their schema neither names nor allows explicitly (through
    additionalProperties, patternProperties or unevaluatedProperties); follows $ref into $defs, anyOf and oneOf
    (the branch the value matches best), items and properties."""
    if not isinstance(schema, dict):
        return []
    defs = defs if defs is not None else schema.get("$defs", {})
    if "$ref" in schema:
        return undeclared_keys(value, defs.get(schema["$ref"].rsplit("/", 1)[-1]), defs)
    branches = schema.get("anyOf") or schema.get("oneOf")
    if branches:
        return min((undeclared_keys(value, b, defs) for b in branches), key=len)
    found = []
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        open_ = any(k in schema for k in ("additionalProperties", "patternProperties", "unevaluatedProperties"))
        for key, item in value.items():
            if key in properties:
                found += undeclared_keys(item, properties[key], defs)
            elif properties and not open_:
                found.append(key)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            found += undeclared_keys(item, schema["items"], defs)
    return found
