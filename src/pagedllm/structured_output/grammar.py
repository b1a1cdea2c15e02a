"""A request's StructuredOutputsParams as llguidance grammar text, and its validation before the request is queued.

Everything that turns a schema, regex, choice or grammar into a grammar is llguidance's own (`grammar_from_*`,
its GBNF-to-Lark converter); this module only picks the call and its options, as vLLM's guidance backend does.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import llguidance
import msgspec
from llguidance.gbnf_to_lark import any_to_lark

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.json_options import close_objects, whitespace_options

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
"""The StructuredOutputsParams fields of which a request sets exactly one."""

VALIDATION_CACHE_SIZE = 256
_validate_pool = ThreadPoolExecutor(4, thread_name_prefix="grammar-validate")
_validated: OrderedDict[str, str] = OrderedDict()
"""grammar -> its validation error ("": valid), the most recent VALIDATION_CACHE_SIZE."""
_validated_lock = threading.Lock()


class StructuredOutputError(ValueError):
    """A request's structured output cannot be compiled; `param` names the field (the OpenAI error's param)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def constraint_of(params: StructuredOutputsParams) -> str:
    """The one constraint field that `params` sets; raises StructuredOutputError for none or several (vLLM's
    messages)."""
    present = [name for name in CONSTRAINTS if getattr(params, name) not in (None, False)]
    if len(present) > 1:
        raise StructuredOutputError("structured_outputs", "You can only use one kind of structured outputs "
                                    f"constraint but multiple are specified: {', '.join(present)}.")
    if not present:
        raise StructuredOutputError("structured_outputs", "You must use one kind of structured outputs constraint "
                                    f"({', '.join(CONSTRAINTS)}) but none are specified.")
    return present[0]


def grammar_of(params: StructuredOutputsParams, disable_any_whitespace: bool = True,
               disable_additional_properties: bool = True) -> str:
    """The llguidance grammar text for `params` (not yet checked: see `check_grammar`).

    Args:
        params: the request's constraint and JSON options.
        disable_any_whitespace, disable_additional_properties: the server's JSON options (StructuredOutputsConfig;
            the defaults are its defaults: compact JSON, closed objects, see json_options.py); a request may also
            ask for either.

    Raises:
        StructuredOutputError: no constraint, several, or a value of the wrong type.
    """
    kind = constraint_of(params)
    param = f"structured_outputs.{kind}"
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else _schema(params.json, param)
        if params.disable_additional_properties or disable_additional_properties:
            schema = close_objects(schema)
        options = whitespace_options(params.disable_any_whitespace or disable_any_whitespace,
                                     params.whitespace_pattern)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as e:
            raise StructuredOutputError(param, f"Invalid JSON schema: {e}") from None
    if kind == "regex":
        regex = _string(params.regex, param)
        try:
            return llguidance.LLMatcher.grammar_from_regex(regex)
        except Exception as e:  # e.g. a lone surrogate, which Rust strings cannot hold
            raise StructuredOutputError(param, f"Invalid regex: {e}") from None
    if kind == "choice":
        choices = params.choice
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
            raise StructuredOutputError(param, "choice must be a non-empty list of strings.")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    try:  # a Lark grammar or a GBNF (EBNF) one, as llguidance takes them
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(_string(params.grammar, param)))
    except StructuredOutputError:
        raise
    except Exception as e:
        raise StructuredOutputError(param, f"Invalid grammar: {e}") from None


def check_grammar(params: StructuredOutputsParams, timeout_s: float, disable_any_whitespace: bool = False,
                  disable_additional_properties: bool = False) -> str:
    """grammar_of(params), then llguidance's validation of it (the grammar compiled as the engine will,
    without the vocabulary), within timeout_s.

    Returns:
        The grammar text.

    Raises:
        StructuredOutputError: invalid, not supported by the backend, or slower to validate than timeout_s.
    """
    grammar = grammar_of(params, disable_any_whitespace, disable_additional_properties)
    param = f"structured_outputs.{constraint_of(params)}"
    try:  # the params cross to the engine as msgpack: UTF-8 only
        msgspec.msgpack.encode(params)
    except (UnicodeEncodeError, msgspec.EncodeError, TypeError):
        raise StructuredOutputError(param, "structured_outputs must be valid Unicode (no lone surrogates).") from None
    error = _validated.get(grammar)
    if error is None:  # not seen lately: validate in a worker, so that a slow one can be given up on
        future = _validate_pool.submit(_validation_error, grammar)
        try:
            error = future.result(timeout=timeout_s)
        except FutureTimeout:
            raise StructuredOutputError(param, f"The grammar took longer than {timeout_s:g} s to compile.") from None
    if error:
        raise StructuredOutputError(param, f"The {param.split('.')[-1]} cannot be compiled: {error.strip()}")
    return grammar


def _validation_error(grammar: str) -> str:
    """llguidance's error message for `grammar` ("" when valid), remembered: a server sees the same schemas again
    (and the offline LLM and the server's InputProcessor check what the request layer checked)."""
    error = llguidance.LLMatcher.validate_grammar(grammar, None)
    with _validated_lock:
        _validated[grammar] = error
        if len(_validated) > VALIDATION_CACHE_SIZE:
            _validated.popitem(last=False)
    return error


def _schema(value: str | dict | None, param: str) -> dict | bool:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise StructuredOutputError(param, f"The JSON schema is not valid JSON: {e}") from None
    if not isinstance(value, (dict, bool)):
        raise StructuredOutputError(param, "The JSON schema must be an object.")
    return value


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise StructuredOutputError(param, f"{param.split('.')[-1]} must be a non-empty string.")
    return value
