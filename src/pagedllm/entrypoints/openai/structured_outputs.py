"""A request's `response_format` (chat) and `structured_outputs` (chat and completions) as SamplingParams'
StructuredOutputsParams, checked before the request is queued (400s whose `param` names the field).

As vLLM does: `response_format` fills `structured_outputs` (json_object or json from the json_schema's schema);
sending a constraint in both is "more than one kind of constraint", a 400. The grammar is compiled once here (by
llguidance, without the vocabulary, in a worker thread so the event loop serves others) within the engine's
compile time limit.
"""

from __future__ import annotations

import asyncio
import functools

import msgspec

from pagedllm.entrypoints.openai import errors
from pagedllm.entrypoints.openai.protocol import SamplingFields
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.grammar import StructuredOutputError, check_grammar, constraint_of


def structured_outputs_of(request: SamplingFields) -> tuple[StructuredOutputsParams | None, str]:
    """The request's StructuredOutputsParams (None: unconstrained) and the request field it came from (the `param`
    of an error about it).

    Raises:
        APIError(400): a value this server cannot honour (structural_tag), a json_schema without a schema, or
            more than one kind of constraint.
    """
    so = request.structured_outputs
    response_format = getattr(request, "response_format", None)
    params = None
    param = "structured_outputs"
    if so is not None:
        if so.structural_tag is not None:
            raise errors.bad_request("structured_outputs.structural_tag is not supported by this server.",
                                     param="structured_outputs.structural_tag")
        params = StructuredOutputsParams(
            json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar, json_object=so.json_object,
            disable_any_whitespace=so.disable_any_whitespace,
            disable_additional_properties=so.disable_additional_properties, whitespace_pattern=so.whitespace_pattern)
    if response_format is not None and response_format.type != "text":
        param = "response_format"
        if response_format.type == "structural_tag":
            raise errors.bad_request("response_format of type structural_tag is not supported by this server.",
                                     param="response_format")
        params = params if params is not None else StructuredOutputsParams()
        if response_format.type == "json_object":
            if params.json_object is not None or params.json is not None:
                raise _several(params)
            params = msgspec.structs.replace(params, json_object=True)
        else:
            schema = response_format.json_schema
            if schema is None or schema.json_schema is None:
                raise errors.bad_request("response_format of type json_schema needs json_schema.schema.",
                                         param="response_format")
            if params.json is not None or params.json_object:
                raise _several(params)
            params = msgspec.structs.replace(params, json=schema.json_schema)
    if params is not None:
        try:
            constraint_of(params)
        except StructuredOutputError as e:
            raise errors.bad_request(str(e), param=param) from None
    return params, param


def _several(params: StructuredOutputsParams) -> errors.APIError:
    return errors.bad_request("You can only use one kind of structured outputs constraint but multiple are "
                              "specified: response_format and structured_outputs.", param="response_format")


async def with_structured_outputs(request: SamplingFields, params: SamplingParams,
                                  timeout_s: float) -> SamplingParams:
    """`params` with the request's structured outputs, once their grammar compiles (in a worker thread).

    Raises:
        APIError(400): see structured_outputs_of; an invalid schema, regex or grammar, a feature the backend
            cannot compile, or a compile slower than timeout_s.
    """
    so, param = structured_outputs_of(request)
    if so is None:
        return params
    check = functools.partial(check_grammar, so, timeout_s)
    try:
        await asyncio.get_running_loop().run_in_executor(None, check)
    except StructuredOutputError as e:
        raise errors.bad_request(str(e), param=param if param == "response_format" else e.param) from None
    return msgspec.structs.replace(params, structured_outputs=so)
