"""How a JSON constraint is generated beyond what its schema says: which objects are closed to keys the schema does
not name, and the whitespace allowed between JSON tokens (llguidance's JSON compile options).

Both defaults make a constrained output end, whatever the model:

- **Closed objects.** An object schema that names its properties and says nothing of others is closed
  (`additionalProperties: false`), as vLLM's default backend (xgrammar, strict mode) and OpenAI's strict mode do.
  llguidance alone follows JSON Schema, where such an object is open: a small model at temperature 0 then invents
  key after key until max_tokens. A schema that says `additionalProperties` (or `unevaluatedProperties`) keeps
  its own choice; a free-form `{"type": "object"}` (no properties named) stays open.
- **No free whitespace.** JSON is written compact, with the separators `", "` and `": "` (json.dumps's and
  xgrammar's), and no other whitespace between tokens: with llguidance's flexible whitespace a sampled stream could
  run into hundreds of newlines. A request's `whitespace_pattern` replaces this (the pattern is the request's own
  bound); the server's `disable_any_whitespace: false` restores llguidance's unbounded flexible whitespace.
"""

from __future__ import annotations

from typing import Any

COMPACT_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance options of JSON without free whitespace."""

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
"""Keywords whose value maps names to schemas (the names are not schemas)."""
_SUBSCHEMAS = ("items", "prefixItems", "additionalItems", "contains", "not", "if", "then", "else", "anyOf",
               "oneOf", "allOf", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
               "propertyNames")
"""Keywords whose value is a schema or a list of schemas."""


def whitespace_options(disable_any_whitespace: bool, whitespace_pattern: str | None) -> dict[str, Any]:
    """The llguidance options of a JSON constraint's whitespace.

    Args:
        disable_any_whitespace: no free whitespace (the default; False: llguidance's flexible whitespace).
        whitespace_pattern: a request's regex for the whitespace between tokens; it wins over both.
    """
    if whitespace_pattern is not None:
        return {"whitespace_flexible": False, "whitespace_pattern": whitespace_pattern}
    if disable_any_whitespace:
        return dict(COMPACT_OPTIONS)
    return {"whitespace_flexible": True}


def close_objects(schema: Any) -> Any:
    """A copy of `schema` in which every object schema that names properties (`properties` or
    `patternProperties`) and does not say `additionalProperties` or `unevaluatedProperties` gets
    `additionalProperties: false`, and every tuple (`prefixItems`) without `items` gets `items: false`.

    A branch of a multi-schema `allOf`, and a schema with `allOf` or `$ref` beside its properties, are not closed
    themselves (their properties are completed elsewhere: closing one part would forbid the other's keys); the
    schemas inside them are. The request's own schema is never changed.

    >>> close_objects({"type": "object", "properties": {"a": {"type": "object"}}})
    {'type': 'object', 'properties': {'a': {'type': 'object'}}, 'additionalProperties': False}
    """
    return _closed(schema, closable=True)


def _closed(schema: Any, closable: bool) -> Any:
    if isinstance(schema, list):
        return [_closed(s, closable) for s in schema]
    if not isinstance(schema, dict):
        return schema  # true, false, or not a schema
    result: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            result[key] = {name: _closed(sub, True) for name, sub in value.items()}
        elif key == "allOf" and isinstance(value, list):
            result[key] = [_closed(sub, len(value) == 1) for sub in value]
        elif key in _SUBSCHEMAS:
            result[key] = _closed(value, True)
        else:
            result[key] = value  # enum, const, default, examples, ...: data, not schemas
    names_properties = isinstance(result.get("properties"), dict) or isinstance(result.get("patternProperties"), dict)
    completed_elsewhere = "allOf" in result or "$ref" in result
    if (closable and names_properties and not completed_elsewhere
            and "additionalProperties" not in result and "unevaluatedProperties" not in result):
        result["additionalProperties"] = False
    if closable and isinstance(result.get("prefixItems"), list) and "items" not in result \
            and "unevaluatedItems" not in result:
        result["items"] = False
    return result
