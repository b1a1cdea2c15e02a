"""Constrained JSON from the real SmolLM2 through a real `pagedllm serve` and the openai client: 23 JSON schemas
(nested objects, arrays, enums, anyOf/oneOf, $ref, open and closed objects, required and optional fields, strict true
and false) and json_object, at temperature 0 and 0.7, all sent at once.

Whatever the model writes: `finish_reason: stop` means the text parses and validates against the schema, with no
key the schema does not name (objects are closed by default, as vLLM's default backend closes them); `length` means
the text is a prefix of valid JSON. Neither has free whitespace (the default compact JSON), so an output can only
run to max_tokens on a value the schema leaves unbounded (a long number or string, an array without maxItems)."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest
from json_checks import free_whitespace, is_json_prefix, undeclared_keys
from server_utils import MODEL_NAME

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from structured_outputs_validity import SCHEMAS as BENCHMARK_SCHEMAS  # noqa: E402

pytestmark = pytest.mark.slow

_POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}
SCHEMAS: dict[str, dict] = {
    **BENCHMARK_SCHEMAS,  # 10 schemas, every object with additionalProperties false
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
               "required": ["name", "age"]},
    "nested_profile": {"type": "object", "required": ["user", "settings"], "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "email": {"type": "string"}},
                 "required": ["id"]},
        "settings": {"type": "object", "properties": {"theme": {"enum": ["dark", "light"]},
                                                      "notifications": {"type": "boolean"}}}}},
    "optional_only": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "number"}}},
    "string_array": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 2, "maxItems": 4},
    "int_enum": {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}, "label": {"type": "string"}},
                 "required": ["level"]},
    "coordinates": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                     "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                    "required": ["lat", "lon"]},
    "defs_and_refs": {"$defs": {"point": _POINT}, "type": "object", "required": ["start", "end"],
                      "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}},
    "one_of": {"type": "object", "required": ["shape"], "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
         "required": ["kind", "r"]},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "number"}},
         "required": ["kind", "side"]}]}}},
    "deep_nesting": {"type": "object", "required": ["a"], "properties": {"a": {
        "type": "object", "required": ["b"], "properties": {"b": {
            "type": "object", "required": ["c"], "properties": {"c": {
                "type": "object", "required": ["d"], "properties": {"d": {"type": "string", "maxLength": 20}}}}}}}}},
    "array_of_open_objects": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"title": {"type": "string"}, "done": {"type": "boolean"}},
        "required": ["title"]}},
    "pydantic_model": {"title": "Book", "type": "object", "description": "A book.", "properties": {
        "title": {"title": "Title", "type": "string"}, "year": {"title": "Year", "type": "integer"},
        "authors": {"title": "Authors", "type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": ["title", "year", "authors"]},
    "free_form_map": {"type": "object", "properties": {"name": {"type": "string"}, "meta": {"type": "object"}},
                      "required": ["name"]},
    "explicit_additional_properties": {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"],
                                       "additionalProperties": {"type": "integer"}, "maxProperties": 3},
}
TEMPERATURES = (0.0, 0.7)
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def client(smollm2_server):
    return smollm2_server.client(timeout=600)


def _request(client, name: str, temperature: float, strict: bool):
    if name.startswith("json_object"):
        response_format = {"type": "json_object"}
        what = ["a cat", "the city of Paris"][int(name[-1])]
    else:
        response_format = {"type": "json_schema",
                           "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": strict}}
        what = name.replace("_", " ")
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": f"Describe {what} as JSON."}],
        response_format=response_format, temperature=temperature, seed=7, max_tokens=MAX_TOKENS)
    return response.choices[0]


def _problems(name: str, choice) -> list[str]:
    text, reason = choice.message.content, choice.finish_reason
    problems = [f"free whitespace {free_whitespace(text)!r}"] if free_whitespace(text) else []
    if reason == "length":
        return problems + ([] if is_json_prefix(text) else ["cut by max_tokens but not a prefix of JSON"])
    if reason != "stop":
        return [*problems, f"finish_reason {reason}"]
    try:
        value = json.loads(text)
    except ValueError as e:
        return [*problems, f"finished but does not parse: {e}"]
    if name.startswith("json_object"):
        return problems + ([] if isinstance(value, dict) else ["not an object"])
    try:
        jsonschema.validate(value, SCHEMAS[name])
    except jsonschema.ValidationError as e:
        return [*problems, f"finished but not valid: {e.message}"]
    keys = undeclared_keys(value, SCHEMAS[name])
    return problems + ([f"keys the schema does not name: {keys}"] if keys else [])


def test_finished_outputs_validate_and_cut_ones_are_prefixes(client):
    jobs = [(name, t, i % 2 == 0) for i, name in enumerate(SCHEMAS) for t in TEMPERATURES]
    jobs += [(f"json_object{i}", t, False) for i in range(2) for t in TEMPERATURES]
    with ThreadPoolExecutor(len(jobs)) as pool:
        choices = list(pool.map(lambda job: _request(client, *job), jobs))
    bad = {job: (choice.finish_reason, problems, choice.message.content[:160])
           for job, choice in zip(jobs, choices, strict=True) if (problems := _problems(job[0], choice))}
    assert not bad
    finished = [job for job, choice in zip(jobs, choices, strict=True) if choice.finish_reason == "stop"]
    assert len(finished) >= len(jobs) // 2, "most outputs end: objects closed, no free whitespace"
