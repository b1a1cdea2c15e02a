"""Tool calls read from JSON text that may still be growing: the calls a stream has produced so far.

Two shapes carry calls: bare objects `{"name": ..., "arguments": {...}}` (a hermes block holds one, llama3_json's
output `;`-separated ones), and arrays of them (mistral's `[TOOL_CALLS][...]`, and the output of
`tool_choice: "required"`, whose objects have `"parameters"`). `scan_calls` walks the text once
(strings, escapes and nesting tracked) and returns, per call object begun, its name once the name's string has
closed and the raw text of its arguments so far. The arguments text only ever grows by appending as the text
grows (trailing whitespace is held back), so a stream can send the new part of it as the next fragment.

>>> scan_calls('[{"name": "f", "parameters": {"a": [1, ', "parameters", in_array=True)
[PartialCall(name='f', arguments='{"a": [1,', complete=False)]
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class PartialCall:
    name: str | None = None
    """Set once the name's JSON string has closed (None: not yet, or not a string)."""
    arguments: str = ""
    """The raw JSON text of the arguments value so far ("" until it begins)."""
    complete: bool = False
    """The call's object has closed."""


def scan_calls(text: str, args_key: str | tuple[str, ...], in_array: bool) -> list[PartialCall]:
    """The call objects in `text`: top-level objects, or (in_array) the objects of a top-level array; `args_key`
    names the member that holds the arguments (a tuple: any of these names)."""
    scanner = _Scanner(text, args_key, 2 if in_array else 1)
    scanner.run()
    return scanner.calls


class _Scanner:
    def __init__(self, text: str, args_key: str | tuple[str, ...], member_depth: int):
        self.text = text
        self.args_keys = (args_key,) if isinstance(args_key, str) else args_key
        self.member_depth = member_depth
        """Nesting depth of a call object's members: 1 for a bare object, 2 inside an array."""
        self.calls: list[PartialCall] = []
        self.depth = 0
        self.expect = "key"  # at member depth: key, colon, value, after (a value ended)
        self.key: str | None = None
        self.value_start: int | None = None

    def run(self) -> None:
        text, depth_of_members = self.text, self.member_depth
        in_string = escape = False
        string_start = 0
        for i, ch in enumerate(text):
            if in_string:
                if escape:
                    escape = False
                elif ch == "\\":
                    escape = True
                elif ch == '"':
                    in_string = False
                    if self.depth == depth_of_members:
                        self._string_closed(string_start, i)
                continue
            if ch == '"':
                in_string = True
                if self.depth == depth_of_members:
                    string_start = i
                    if self.expect == "value":
                        self.value_start = i
            elif ch in "{[":
                if self.depth == depth_of_members and self.expect == "value":
                    self.value_start = i
                self.depth += 1
                if self.depth == depth_of_members and ch == "{":
                    self.calls.append(PartialCall())
                    self.expect, self.key, self.value_start = "key", None, None
            elif ch in "}]":
                if self.depth == depth_of_members:  # the call object closes: a scalar value ends here
                    self._value_ended(i)
                    if self.calls:
                        self.calls[-1].complete = True
                self.depth -= 1
                if self.depth == depth_of_members and self.expect == "value" and self.value_start is not None:
                    self._value_ended(i + 1)  # an object or array value closed
            elif self.depth == depth_of_members:
                if ch == ":" and self.expect == "colon":
                    self.expect, self.value_start = "value", None
                elif ch == ",":
                    self._value_ended(i)
                    self.expect, self.key = "key", None
                elif not ch.isspace() and self.expect == "value" and self.value_start is None:
                    self.value_start = i  # a number, true, false or null
        if self.expect == "value" and self.value_start is not None:  # the value still growing
            self._record(text[self.value_start:])

    def _string_closed(self, start: int, end: int) -> None:
        literal = self.text[start:end + 1]
        if self.expect == "key":
            self.key, self.expect = _loads_str(literal), "colon"
        elif self.expect == "value":
            if self.key == "name" and self.calls:
                self.calls[-1].name = _loads_str(literal)
            self._value_ended(end + 1)

    def _value_ended(self, end: int) -> None:
        if self.expect == "value" and self.value_start is not None:
            self._record(self.text[self.value_start:end])
            self.expect, self.value_start = "after", None

    def _record(self, value_text: str) -> None:
        if self.key in self.args_keys and self.calls:
            self.calls[-1].arguments = value_text.rstrip()


def _loads_str(literal: str) -> str | None:
    try:
        value = json.loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def partial_marker_len(text: str, *markers: str) -> int:
    """Length of the longest end of `text` that begins one of `markers` (text a stream holds back while it may
    still become a marker)."""
    for n in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(marker.startswith(text[-n:]) for marker in markers):
            return n
    return 0
