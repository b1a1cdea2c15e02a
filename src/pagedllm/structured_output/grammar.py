"""A request's StructuredOutputsParams as llguidance grammar text, and its validation before the request is queued.

Everything that turns a schema, regex, choice or grammar into a grammar is llguidance's own (`grammar_from_*`,
its GBNF-to-Lark converter); this module only picks the call and its options, as vLLM's guidance backend does.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import llguidance
import msgspec
from llguidance.gbnf_to_lark import any_to_lark

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output import bounds
from pagedllm.structured_output.bounds import BigStackExecutor, ConstraintLimitError
from pagedllm.structured_output.json_options import close_objects, whitespace_options

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
"""The StructuredOutputsParams fields of which a request sets exactly one."""

VALIDATION_CACHE_SIZE = 256
_validate_pool: BigStackExecutor | None = None
"""The in-process validation thread (offline LLM, and the server's InputProcessor on a cache miss), started on
first use; the API server validates in a child process first (entrypoints/openai/grammar_process.py)."""
_validated: OrderedDict[str, str] = OrderedDict()
"""grammar -> its validation error ("": valid), the most recent VALIDATION_CACHE_SIZE."""
_validated_lock = threading.Lock()
PREPARED_CACHE_SIZE = 64
_prepared: OrderedDict[bytes, str] = OrderedDict()
"""sha256 of (params as msgpack, the JSON options) -> grammar_of's text, the most recent PREPARED_CACHE_SIZE."""


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
        StructuredOutputError: no constraint, several, a value of the wrong type, or one past a limit of
            bounds.py (checked before llguidance sees it: past them, its native recursion could overflow the
            compile thread's stack).
    """
    kind = constraint_of(params)
    param = f"structured_outputs.{kind}"
    try:
        return _grammar_of(params, kind, param, disable_any_whitespace, disable_additional_properties)
    except ConstraintLimitError as e:
        raise StructuredOutputError(param, str(e)) from None


def _grammar_of(params: StructuredOutputsParams, kind: str, param: str, disable_any_whitespace: bool,
                disable_additional_properties: bool) -> str:
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else _schema(params.json, param)
        bounds.check_schema(schema)
        if isinstance(params.whitespace_pattern, str):
            bounds.check_bytes("whitespace_pattern", params.whitespace_pattern, bounds.MAX_REGEX_BYTES)
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
        bounds.check_bytes("regex", regex, bounds.MAX_REGEX_BYTES)
        try:
            return llguidance.LLMatcher.grammar_from_regex(regex)
        except Exception as e:  # e.g. a lone surrogate, which Rust strings cannot hold
            raise StructuredOutputError(param, f"Invalid regex: {e}") from None
    if kind == "choice":
        choices = params.choice
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
            raise StructuredOutputError(param, "choice must be a non-empty list of strings.")
        bounds.check_choice(choices)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    text = _string(params.grammar, param)
    bounds.check_bytes("grammar", text, bounds.MAX_GRAMMAR_BYTES)
    try:  # a Lark grammar or a GBNF (EBNF) one, as llguidance takes them
        lark = any_to_lark(text)
    except Exception as e:
        raise StructuredOutputError(param, f"Invalid grammar: {e}") from None
    bounds.check_lark(lark)
    return llguidance.LLMatcher.grammar_from_lark(lark)


def prepared_grammar(params: StructuredOutputsParams, disable_any_whitespace: bool = False,
                     disable_additional_properties: bool = False) -> tuple[str, str]:
    """grammar_of(params) and the field an error about it names; raises StructuredOutputError (see grammar_of;
    params that cannot cross to the engine as msgpack).

    The most recent PREPARED_CACHE_SIZE answers are kept by a digest of the params (see prepared_key): the API
    server's grammar child prepares a request's grammar, and the InputProcessor asks again, on the event loop,
    where a 2,000-branch schema's bounds walk and grammar text took ~90 ms from every other stream."""
    key, param = prepared_key(params, disable_any_whitespace, disable_additional_properties)
    grammar = prepared_lookup(key)
    if grammar is None:
        grammar = grammar_of(params, disable_any_whitespace, disable_additional_properties)
        remember_prepared(key, grammar)
    return grammar, param


def prepared_key(params: StructuredOutputsParams, disable_any_whitespace: bool,
                 disable_additional_properties: bool) -> tuple[bytes, str]:
    """The digest prepared grammars are remembered by, and the field an error names. Raises
    StructuredOutputError: no constraint or several; params that cannot cross to the engine as msgpack."""
    param = f"structured_outputs.{constraint_of(params)}"
    try:  # the params cross to the engine as msgpack: UTF-8 only
        encoded = msgspec.msgpack.encode(params)
    except (UnicodeEncodeError, msgspec.EncodeError, TypeError, OverflowError) as e:
        grammar_of(params, disable_any_whitespace, disable_additional_properties)  # its own error comes first
        reason = ("its integers must fit 64 bits" if isinstance(e, OverflowError)
                  else "it must be valid Unicode (no lone surrogates)")
        raise StructuredOutputError(param, f"{param} cannot be used: {reason}.") from None
    return hashlib.sha256(encoded + bytes([disable_any_whitespace, disable_additional_properties])).digest(), param


def prepared_lookup(key: bytes) -> str | None:
    """The remembered grammar text of prepared_key `key` (None: not prepared lately)."""
    with _validated_lock:
        return _prepared.get(key)


def remember_prepared(key: bytes, grammar: str) -> None:
    with _validated_lock:
        _prepared[key] = grammar
        while len(_prepared) > PREPARED_CACHE_SIZE:
            _prepared.popitem(last=False)


def check_grammar(params: StructuredOutputsParams, timeout_s: float, disable_any_whitespace: bool = False,
                  disable_additional_properties: bool = False) -> str:
    """grammar_of(params), then llguidance's validation of it (the grammar compiled as the engine will,
    without the vocabulary), within timeout_s, in this process (on a big-stack thread).

    Returns:
        The grammar text.

    Raises:
        StructuredOutputError: invalid, past a limit, not supported by the backend, or slower to validate than
            timeout_s.
    """
    global _validate_pool
    grammar, param = prepared_grammar(params, disable_any_whitespace, disable_additional_properties)
    error = cached_validation(grammar)
    if error is None:  # not seen lately: validate in a worker, so that a slow one can be given up on
        with _validated_lock:
            if _validate_pool is None:
                _validate_pool = BigStackExecutor("grammar-validate")
        future = _validate_pool.submit(validation_error, grammar)
        try:
            error = future.result(timeout=timeout_s)
        except FutureTimeout:
            future.cancel()
            raise StructuredOutputError(param, f"The grammar took longer than {timeout_s:g} s to compile.") from None
    raise_for_validation(param, error)
    return grammar


def raise_for_validation(param: str, error: str) -> None:
    """Raises StructuredOutputError for llguidance's validation message `error` ("": valid)."""
    if error:
        raise StructuredOutputError(param, f"The {param.split('.')[-1]} cannot be compiled: {error.strip()}")


def cached_validation(grammar: str) -> str | None:
    """The remembered validation message of `grammar` ("": valid; None: not seen lately)."""
    with _validated_lock:
        error = _validated.get(grammar)
        if error is not None:
            _validated.move_to_end(grammar)
        return error


def remember_validation(grammar: str, error: str) -> None:
    """Remember `grammar`'s validation message: a server sees the same schemas again (and the offline LLM and
    the server's InputProcessor check what the request layer checked)."""
    with _validated_lock:
        _validated[grammar] = error
        if len(_validated) > VALIDATION_CACHE_SIZE:
            _validated.popitem(last=False)


def validation_error(grammar: str) -> str:
    """llguidance's error message for `grammar` ("" when valid), remembered. Call it on a thread with a
    bounds.STACK_BYTES stack."""
    error = llguidance.LLMatcher.validate_grammar(grammar, None)
    remember_validation(grammar, error)
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
