"""StructuredOutputsParams -> llguidance grammar, and the checks that answer bad input before it is queued."""

from __future__ import annotations

import json
import time

import pytest

from pagedllm.config import EngineConfig, StructuredOutputsConfig
from pagedllm.sampling_params import StructuredOutputsParams as S
from pagedllm.structured_output import grammar as grammar_module
from pagedllm.structured_output.grammar import StructuredOutputError, check_grammar, prepared_key


def _error(params: S, timeout_s: float = 10.0) -> StructuredOutputError:
    with pytest.raises(StructuredOutputError) as info:
        check_grammar(params, timeout_s)
    return info.value


@pytest.mark.parametrize("params, param, text", [
    (S(json={"type": "frob"}), "structured_outputs.json", "Invalid type: frob"),
    (S(json="{not json"), "structured_outputs.json", "not valid JSON"),
    (S(json={"type": "string", "format": "no-such-format"}), "structured_outputs.json", "Unknown format"),
    (S(json={"$ref": "#/$defs/missing"}), "structured_outputs.json", "does not exist"),
    (S(regex="a(b"), "structured_outputs.regex", "unclosed group"),
    (S(grammar="start: undefined_rule"), "structured_outputs.grammar", "unknown name"),
    (S(choice=[]), "structured_outputs.choice", "non-empty list"),
    (S(regex="a", choice=["a"]), "structured_outputs", "multiple are specified: regex, choice"),
    (S(json={"type": "object"}, json_object=True), "structured_outputs", "multiple"),
    (S(disable_any_whitespace=True), "structured_outputs", "none are specified"),
    (S(regex="\ud800"), "structured_outputs.regex", "Invalid regex"),  # a lone surrogate (JSON allows "\ud800")
    (S(json={"\ud800": {}}), "structured_outputs.json", "valid Unicode"),
])
def test_bad_input_names_the_field(params, param, text):
    error = _error(params)
    assert error.param == param
    assert text in str(error)


def test_params_that_cannot_cross_to_the_engine_are_refused_naming_the_field():
    """The API server's digest of the params (msgpack, as they cross to the engine): an integer past 64 bits was an
    OverflowError there, a 500 a fuzzer found; now the schema's own error, a 400 naming the field."""
    with pytest.raises(StructuredOutputError) as info:
        prepared_key(S(json={"enum": [279625954528442454114304]}), True, True)
    assert info.value.param == "structured_outputs.json" and "not JSON serializable" in str(info.value)


def test_a_compile_over_the_time_limit_is_refused(monkeypatch):
    def slow(grammar: str) -> str:
        time.sleep(0.5)
        return ""

    monkeypatch.setattr(grammar_module, "validation_error", slow)
    error = _error(S(regex="[0-9]+ (the time-limit test)"), timeout_s=0.05)
    assert error.param == "structured_outputs.regex"
    assert "longer than 0.05 s" in str(error)


def test_a_grammar_seen_before_is_answered_without_the_worker(monkeypatch):
    params = S(json={"type": "object", "properties": {"cached": {"type": "boolean"}}})
    check_grammar(params, 10.0)

    def busy(grammar: str) -> str:
        raise AssertionError("validated again")

    monkeypatch.setattr(grammar_module, "validation_error", busy)
    assert check_grammar(params, 10.0)  # e.g. the InputProcessor after the request layer: no wait on the pool


@pytest.mark.parametrize("params", [
    S(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
    S(json=json.dumps({"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2})),
    S(json_object=True), S(regex=r"\d{3}-[a-z]+"), S(choice=["yes", "no"]),
    S(grammar='start: "a" b\nb: "b"+'),  # Lark
    S(grammar='root ::= "a" [0-9]+'),  # GBNF (EBNF)
])
def test_valid_constraints_compile(params):
    assert check_grammar(params, 10.0)


def test_backend_choice():
    assert EngineConfig.from_kwargs().structured_outputs_config.backend == "auto"
    assert EngineConfig.from_kwargs(structured_outputs_config='{"backend": "guidance"}').structured_outputs_config \
        .backend == "guidance"
    with pytest.raises(ValueError, match="xgrammar. is not supported by this pagedllm build .xgrammar pulls triton"):
        StructuredOutputsConfig.parse('{"backend": "xgrammar"}')
    with pytest.raises(ValueError, match="'outlines' is not supported by this pagedllm build; supported"):
        StructuredOutputsConfig.parse({"backend": "outlines"})
    with pytest.raises(ValueError, match="unknown --structured-outputs-config keys: nope"):
        StructuredOutputsConfig.parse('{"nope": 1}')
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsConfig.parse("{")


def test_a_prepared_grammar_is_made_once(monkeypatch):
    """The API server's grammar child prepares a request's grammar and the InputProcessor asks again, on the
    event loop: the second ask is a lookup (the bounds walk and grammar text of a big schema took ~90 ms there)."""
    made = []
    real = grammar_module.grammar_of
    monkeypatch.setattr(grammar_module, "grammar_of", lambda *args: made.append(args) or real(*args))
    params = S(json={"type": "object", "properties": {"prepared_once": {"type": "integer"}}})
    first = grammar_module.prepared_grammar(params, True, True)
    assert grammar_module.prepared_grammar(S(json=dict(params.json)), True, True) == first  # equal params: a hit
    assert len(made) == 1
    grammar_module.prepared_grammar(params, False, True)  # other JSON options: another grammar
    assert len(made) == 2
