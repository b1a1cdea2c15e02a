"""Streamed chunks written from a template: the bytes pydantic would write, without a pydantic model per token.

Building a `CompletionStreamResponse` (or the chat one) per output token and dumping it cost more API-server CPU
than the rest of the stream path together (the models' wrap validator runs on every construction). The chunks
of one stream differ only in a few scalar fields, so `SSETemplate` dumps the response model once, with marker
strings in those fields, and splits the JSON at the markers; a chunk is then the parts joined with each value's
JSON (msgspec writes strings exactly as pydantic-core does: non-ASCII as UTF-8, the same escapes). Field order,
defaults and nulls come from the model itself, so a field added to the model appears in the template too.
tests/entrypoints/test_sse_template.py checks the bytes against pydantic's.
"""

from __future__ import annotations

import msgspec
from pydantic import BaseModel

_encode = msgspec.json.Encoder().encode


def _marker(name: str) -> str:
    return f"\x00hole:{name}\x00"


class SSETemplate:
    """`data: <JSON>\\n\\n` of one model with holes.

    Args:
        model: the response, built with `model_construct` so that every hole's field holds `marker(name)`.
        holes: the hole names, in the order their values are given to `render`.
    """

    marker = staticmethod(_marker)

    def __init__(self, model: BaseModel, holes: tuple[str, ...]):
        text = "data: " + model.model_dump_json(warnings=False) + "\n\n"
        parts: list[str] = []
        for name in holes:
            quoted = _encode(_marker(name)).decode()
            before, found, text = text.partition(quoted)
            if not found or quoted in text:
                raise ValueError(f"hole {name!r} must appear exactly once in the template")
            parts.append(before)
        parts.append(text)
        self._parts = parts

    def render(self, *values: str | int | None) -> str:
        """The chunk with each hole's value as JSON (a str, an int or None)."""
        parts = self._parts
        out = [parts[0]]
        for value, part in zip(values, parts[1:], strict=True):
            out.append(_encode(value).decode())
            out.append(part)
        return "".join(out)
