"""The JSON options every JSON constraint is compiled with: objects closed to keys their schema does not name and no
free whitespace by default (the server's StructuredOutputsConfig), a request's strict / whitespace_pattern on top.
Checked on the grammar llguidance compiles, with the tiny tokenizer: which texts it accepts."""

from __future__ import annotations

import pytest

from pagedllm.config import StructuredOutputsConfig
from pagedllm.sampling_params import StructuredOutputsParams as S
from pagedllm.structured_output.backend_guidance import GuidanceBackend
from pagedllm.structured_output.grammar import grammar_of
from pagedllm.structured_output.json_options import close_objects

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
    "type": "object", "properties": {"t": {"type": "integer"}}}}}, "required": ["name"]}


@pytest.fixture(scope="module")
def accepts(tiny_tokenizer):
    backend = GuidanceBackend(tiny_tokenizer, len(tiny_tokenizer))

    def accepts(params: S, text: str, **server_options) -> bool:
        """Whether the grammar of `params` takes `text` whole and may end there."""
        matcher = backend.compile(grammar_of(params, **server_options))
        token_ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        if matcher.validate_tokens(token_ids) < len(token_ids):
            return False
        matcher.consume_tokens(token_ids)
        return matcher.is_accepting()

    return accepts


def test_the_defaults_are_compact_closed_json():
    config = StructuredOutputsConfig()
    assert config.disable_any_whitespace and config.disable_additional_properties


def test_by_default_objects_are_closed_and_json_is_compact(accepts):
    assert accepts(S(json=PERSON), '{"name": "a", "tags": [{"t": 1}, {}]}')
    assert not accepts(S(json=PERSON), '{"name": "a", "extra": 1}')  # a key the schema does not name
    assert not accepts(S(json=PERSON), '{"name": "a", "tags": [{"t": 1, "u": 2}]}')  # nor in a nested object
    assert not accepts(S(json=PERSON), '{\n  "name": "a"\n}')  # free whitespace
    assert not accepts(S(json=PERSON), '{"name":"a"}')  # the separators are ", " and ": "
    assert accepts(S(json_object=True), '{"any": {"key": [1, 2]}}')  # a free-form object stays open


def test_the_server_options_turned_off_follow_json_schema(accepts):
    lax = {"disable_any_whitespace": False, "disable_additional_properties": False}
    assert accepts(S(json=PERSON), '{\n  "name": "a",\n  "extra": 1\n}', **lax)
    # a request still asks for either: strict (disable_additional_properties) and disable_any_whitespace
    assert not accepts(S(json=PERSON, disable_additional_properties=True), '{"name": "a", "extra": 1}', **lax)
    assert not accepts(S(json=PERSON, disable_any_whitespace=True), '{\n  "name": "a"}', **lax)


def test_a_request_whitespace_pattern_is_its_bound(accepts):
    params = S(json=PERSON, whitespace_pattern="[ ]{0,2}")
    assert accepts(params, '{  "name"  :  "a"}')
    assert not accepts(params, '{   "name": "a"}')  # three spaces: past the pattern


def test_an_explicit_additional_properties_is_kept(accepts):
    schema = {"type": "object", "properties": {"k": {"type": "string"}}, "additionalProperties": {"type": "integer"}}
    assert accepts(S(json=schema), '{"k": "v", "n": 1}')
    assert not accepts(S(json=schema), '{"k": "v", "n": "x"}')


def test_close_objects_closes_schemas_only():
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {}}},
                                               "free": {"type": "object"}},
              "$defs": {"d": {"properties": {"x": {"type": "integer"}}}},
              "allOf": [{"properties": {"a": {}}}, {"properties": {"b": {"type": "object", "properties": {}}}}],
              "prefixItems": [{"type": "integer"}], "const": {"properties": {"c": 1}},
              "anyOf": [{"properties": {"y": {}}, "unevaluatedProperties": True}]}
    closed = close_objects(schema)
    assert closed["properties"]["properties"]["additionalProperties"] is False  # a property named "properties"
    assert "additionalProperties" not in closed["properties"]["free"]  # a free-form object stays open
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in closed  # has allOf beside its properties: completed by the branches
    assert [("additionalProperties" in branch) for branch in closed["allOf"]] == [False, False]
    assert closed["allOf"][1]["properties"]["b"]["additionalProperties"] is False  # inside a branch: closed
    assert closed["items"] is False  # a tuple takes no items past prefixItems
    assert closed["const"] == {"properties": {"c": 1}}  # data, not a schema
    assert "additionalProperties" not in closed["anyOf"][0]  # says unevaluatedProperties itself
    assert "additionalProperties" not in schema["properties"]["properties"]  # the request's schema is unchanged
