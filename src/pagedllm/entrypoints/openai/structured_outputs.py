"""A request's structured-output fields (`structured_outputs`, `response_format`, the old `guided_*`) as
SamplingParams' StructuredOutputsParams, checked before the request is queued (400s whose `param` names the field).

As vLLM does: `response_format` fills `structured_outputs` (json_object, or json from the json_schema's schema;
`strict: true` closes its objects), and the `guided_*` fields are aliases of `structured_outputs`' fields. A
constraint sent in two of these fields is "more than one kind of constraint", a 400. The grammar is compiled once
here (by llguidance, without the vocabulary, in a child process: grammar_process.py) within the engine's compile
time limit, with the server's JSON options, as the engine will compile it; its size and depth are checked first
(structured_output/bounds.py).
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from pagedllm.config import STRUCTURED_OUTPUT_BACKENDS
from pagedllm.entrypoints.openai import errors
from pagedllm.entrypoints.openai.grammar_process import GrammarProcessError, validator
from pagedllm.entrypoints.openai.structured_outputs_protocol import StructuredOutputFields, StructuredOutputsRequest
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.grammar import (
    PREPARED_CACHE_SIZE,
    StructuredOutputError,
    cached_validation,
    constraint_of,
    prepared_key,
    prepared_lookup,
    raise_for_validation,
    remember_prepared,
    remember_validation,
)

GUIDED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar", "guided_json_object": "json_object",
                  "guided_whitespace_pattern": "whitespace_pattern"}
"""vLLM's old request fields -> the StructuredOutputsParams field each stands for."""


def structured_outputs_of(request: StructuredOutputFields) -> tuple[StructuredOutputsParams | None, str]:
    """The request's StructuredOutputsParams (None: unconstrained) and the request field it came from (the `param`
    of an error about it).

    Raises:
        APIError(400): a value this server cannot honour (structural_tag, another guided_decoding_backend), a
            json_schema without a schema, or more than one kind of constraint.
    """
    _check_unsupported(request)
    params, param = _from_structured_outputs(request.structured_outputs)
    params, param = _with_guided_fields(request, params, param)
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        param = "response_format"
        params = params if params is not None else StructuredOutputsParams()
        if response_format.type == "json_object":
            if params.json_object is not None or params.json is not None:
                raise _several("response_format")
            params = msgspec.structs.replace(params, json_object=True)
        else:
            schema = response_format.json_schema
            if schema is None or schema.json_schema is None:
                raise errors.bad_request("response_format of type json_schema needs json_schema.schema.",
                                         param="response_format")
            if params.json is not None or params.json_object:
                raise _several("response_format")
            params = msgspec.structs.replace(params, json=schema.json_schema, disable_additional_properties=bool(
                schema.strict) or params.disable_additional_properties)
    if params is not None:
        try:
            constraint_of(params)
        except StructuredOutputError as e:
            raise errors.bad_request(str(e), param=param) from None
    return params, param


def _check_unsupported(request: StructuredOutputFields) -> None:
    so = request.structured_outputs
    if so is not None and so.structural_tag is not None:
        raise errors.bad_request("structured_outputs.structural_tag is not supported by this server.",
                                 param="structured_outputs.structural_tag")
    if request.structural_tag is not None:
        raise errors.bad_request("structural_tag is not supported by this server.", param="structural_tag")
    if request.response_format is not None and request.response_format.type == "structural_tag":
        raise errors.bad_request("response_format of type structural_tag is not supported by this server.",
                                 param="response_format")
    backend = request.guided_decoding_backend
    if backend is not None and backend not in STRUCTURED_OUTPUT_BACKENDS:
        raise errors.bad_request(
            f"guided_decoding_backend {backend!r} is not available: this server compiles every request with "
            f"llguidance ({' or '.join(STRUCTURED_OUTPUT_BACKENDS)}); request-level backend selection is not "
            "supported (as in vLLM's V1 engine). Leave the field out.", param="guided_decoding_backend")


def _from_structured_outputs(so: StructuredOutputsRequest | None) -> tuple[StructuredOutputsParams | None, str]:
    if so is None:
        return None, "structured_outputs"
    return StructuredOutputsParams(
        json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar, json_object=so.json_object,
        disable_any_whitespace=so.disable_any_whitespace,
        disable_additional_properties=so.disable_additional_properties,
        whitespace_pattern=so.whitespace_pattern), "structured_outputs"


def _with_guided_fields(request: StructuredOutputFields, params: StructuredOutputsParams | None,
                        param: str) -> tuple[StructuredOutputsParams | None, str]:
    """`params` with the request's guided_* fields, each in the StructuredOutputsParams field it stands for; one
    that `params` already sets (to another value) is a 400 naming it."""
    given = {name: getattr(request, name) for name in GUIDED_ALIASES if getattr(request, name) is not None}
    if not given:
        return params, param
    params = params if params is not None else StructuredOutputsParams()
    for name, value in given.items():
        field = GUIDED_ALIASES[name]
        current = getattr(params, field)
        if current is not None and current != value:
            raise errors.bad_request(f"{name} and structured_outputs.{field} are both given; send one.", param=name)
        params = msgspec.structs.replace(params, **{field: value})
    constraints = [name for name in given if GUIDED_ALIASES[name] != "whitespace_pattern"]
    alone = request.structured_outputs is None and len(constraints) == 1
    return params, constraints[0] if alone else param


def _several(param: str) -> errors.APIError:
    return errors.bad_request("You can only use one kind of structured outputs constraint but multiple are "
                              "specified: response_format and structured_outputs.", param=param)


async def with_structured_outputs(request: StructuredOutputFields, params: SamplingParams, timeout_s: float,
                                  json_options: tuple[bool, bool] = (True, True)) -> SamplingParams:
    """`params` with the request's structured outputs, once their grammar compiles (in a child process).

    Args:
        json_options: the server's (disable_any_whitespace, disable_additional_properties).

    Raises:
        APIError(400): see structured_outputs_of; an invalid schema, regex or grammar, a feature the backend
            cannot compile, or a compile slower than timeout_s.
    """
    so, param = structured_outputs_of(request)
    if so is None:
        return params
    try:
        await check_grammar_in_child(so, timeout_s, json_options)
    except StructuredOutputError as e:
        field = param if param in ("response_format", *GUIDED_ALIASES) else e.param
        raise errors.bad_request(str(e), param=field) from None
    return msgspec.structs.replace(params, structured_outputs=so)


async def check_grammar_in_child(params: StructuredOutputsParams, timeout_s: float,
                                 json_options: tuple[bool, bool]) -> None:
    """grammar.check_grammar, with the grammar made (its bounds checked) and validated by llguidance in a child
    process (grammar_process.py): a compile past timeout_s is killed, a crash fails this request alone, and the
    Python work of a big schema (~100-300 ms for 2,000 branches) takes no turns from the event loop's streams.
    The answer is remembered here, so the InputProcessor's check_grammar finds it. Raises StructuredOutputError."""
    key, param = prepared_key(params, *json_options)
    grammar = prepared_lookup(key)
    error = cached_validation(grammar) if grammar is not None else _crashed.get(key)
    if error is None:
        try:
            reply = await validator().prepare(msgspec.json.encode(params), json_options, timeout_s)
        except GrammarProcessError as e:
            if "crashed" in str(e):  # the same params again get the same answer, without a crash
                _crashed[key] = str(e)
                while len(_crashed) > PREPARED_CACHE_SIZE:
                    _crashed.popitem(last=False)
            raise StructuredOutputError(param, str(e)) from None
        if "message" in reply:
            raise StructuredOutputError(reply["param"], reply["message"])
        error = reply["error"]
        remember_prepared(key, reply["grammar"])
        remember_validation(reply["grammar"], error)
    raise_for_validation(param, error)


_crashed: OrderedDict[bytes, str] = OrderedDict()
"""prepared_key -> the message of a grammar that crashed its child (the most recent PREPARED_CACHE_SIZE)."""
