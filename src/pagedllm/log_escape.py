"""Text from a request, made safe to log: control characters become escapes.

A request_id, a path or an error message that quotes a request can carry a newline (a forged log line),
a NUL, or a terminal escape sequence. Every value a request supplied goes through `escape_control` before
it reaches a log line; the format string and numbers need not.
"""

from __future__ import annotations

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_ESCAPES = {code: _NAMED.get(chr(code), f"\\x{code:02x}") for code in (*range(0x20), *range(0x7F, 0xA0))}
_ESCAPES.update({0x2028: "\\u2028", 0x2029: "\\u2029"})  # line and paragraph separators


def escape_control(value: object) -> str:
    """str(value) with every C0/C1 control character and line separator written as an escape
    ("a\\nb" -> "a\\\\nb"): one log record stays one line of printable text."""
    return str(value).translate(_ESCAPES)
