"""Tool calling in /v1/chat/completions, as vLLM serves it: the request's `tools` and `tool_choice` checked
before queueing, the tools handed to the chat template, `required` and a named function enforced through a JSON
schema (`SamplingParams.structured_outputs`), and the output turned into `tool_calls`, whole or as stream
deltas shaped as the OpenAI SDK reassembles them.

- `none` (the default without tools): plain text; the tools still go to the template unless
  --exclude-tools-when-tool-choice-none.
- `auto` (the default with tools): needs --enable-auto-tool-choice and --tool-call-parser; the parser reads calls
  out of free text (`tool_parsers/hermes.py`).
- `required`: the output must be a JSON array of at least one `{"name", "parameters"}`, one schema per tool
  (at most one item with parallel_tool_calls false).
- a named function: the output is that function's arguments, constrained by its `parameters` schema.

A message with tool calls finishes with `tool_calls` (unless cut by max_tokens: `length`).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import msgspec

from pagedllm.config import ServerConfig
from pagedllm.entrypoints.openai import errors
from pagedllm.entrypoints.openai.chat_protocol import ChatCompletionRequest, ChatMessage, DeltaMessage
from pagedllm.entrypoints.openai.structured_outputs import GUIDED_ALIASES, check_grammar_in_child
from pagedllm.entrypoints.openai.tool_parsers import hermes
from pagedllm.entrypoints.openai.tool_parsers.partial_calls import PartialCall, scan_calls
from pagedllm.entrypoints.openai.tool_protocol import (
    ChatCompletionNamedToolChoiceParam,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    random_tool_call_id,
)
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.bounds import ConstraintLimitError, check_schema
from pagedllm.structured_output.grammar import StructuredOutputError
from pagedllm.structured_output.json_options import close_objects


class ToolCalling:
    """What a chat request asks of tools; raises APIError(400) for a request vLLM refuses."""

    def __init__(self, request: ChatCompletionRequest, config: ServerConfig):
        self.tools = request.tools
        self.parallel = request.parallel_tool_calls is not False
        choice = request.tool_choice
        if self.tools is not None and not self.tools:
            raise errors.bad_request("Invalid 'tools': empty array. Expected an array with minimum length 1 (leave "
                                     "tools out for no tools).", param="tools")
        if choice is None:
            choice = "auto" if self.tools else "none"
        if choice != "none" and not self.tools:
            raise errors.bad_request("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        self.function_name: str | None = None
        if isinstance(choice, ChatCompletionNamedToolChoiceParam):
            self.function_name = choice.function.name
            if self.function_name not in {tool.function.name for tool in self.tools}:
                raise errors.bad_request(f"The tool specified in `tool_choice` ({self.function_name!r}) does not "
                                         "match any of the specified `tools`.", param="tool_choice")
            choice = "named"
        if choice == "auto" and not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise errors.bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                     "to be set.", param="tool_choice")
        if choice in ("required", "named") and _has_output_constraint(request):
            raise errors.bad_request("tool_choice 'required' or a named function constrains the output to tool "
                                     "calls; it cannot be combined with structured_outputs or response_format.",
                                     param="tool_choice")
        self.mode: str = choice
        """none, auto, required or named."""
        self.template_tools = None if self.tools is None or (
            choice == "none" and config.exclude_tools_when_tool_choice_none) else [
            tool.model_dump(exclude_none=True) for tool in self.tools]
        """The tools as the chat template sees them (OpenAI's `{"type": "function", "function": {...}}`)."""
        if choice in ("required", "named"):
            _check_parameters(self.tools)
        self.schema = self._schema()

    def _schema(self) -> dict[str, Any] | None:
        """vLLM's JSON schema for `required` (each call object closed to other keys) and a named function (None for
        none and auto)."""
        if self.mode == "named":
            return _parameters(next(t for t in self.tools if t.function.name == self.function_name))
        if self.mode != "required":
            return None
        items, defs = [], {}
        for tool in self.tools:
            parameters = _parameters(tool)
            for name, schema in parameters.pop("$defs", {}).items():
                if defs.setdefault(name, schema) != schema:
                    raise errors.bad_request(f"Tool definition '{name}' has multiple schemas, which is not "
                                             "supported.", param="tools")
            # additionalProperties false (not in vLLM's schema): keys other than name and parameters are dropped by
            # the parser anyway, and a weak model kept writing them until max_tokens
            items.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                         "parameters": parameters},
                          "required": ["name", "parameters"], "additionalProperties": False})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema

    async def constrain(self, params: SamplingParams, timeout_s: float,
                        json_options: tuple[bool, bool] = (True, True)) -> SamplingParams:
        """`params`, for required and named with the tools' schema as their structured output (enforced by the
        backend), once it compiles within timeout_s (in a worker thread) with the server's JSON options
        (disable_any_whitespace, disable_additional_properties); raises APIError(400, param tools)."""
        if self.schema is None:
            return params
        # compact JSON whatever the server's option: with flexible whitespace a weak model (a random one always)
        # writes whitespace until max_tokens instead of the call (vLLM leaves whitespace free here)
        constraint = StructuredOutputsParams(json=self.schema, disable_any_whitespace=True)
        try:
            await check_grammar_in_child(constraint, timeout_s, json_options)
        except StructuredOutputError as e:
            raise errors.bad_request(f"The tools' parameters cannot be enforced: {e}", param="tools") from None
        return msgspec.structs.replace(params, structured_outputs=constraint)

    @property
    def parses_output(self) -> bool:
        return self.mode in ("auto", "required", "named")

    def message(self, text: str, finish_reason: str | None) -> tuple[ChatMessage, str | None]:
        """The assistant message of a finished output, and its finish_reason."""
        content, calls = self._calls(text)
        if not self.parallel:
            calls = calls[:1]
        tool_calls = [ToolCall(function=FunctionCall(name=name, arguments=arguments)) for name, arguments in calls]
        return (ChatMessage(role="assistant", content=content, tool_calls=tool_calls),
                _finish_reason(bool(tool_calls), finish_reason))

    def _calls(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        if self.mode == "named":
            return "", [(self.function_name, text)]
        if self.mode == "required":
            try:
                calls = json.loads(text)
                return "", [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
            except (ValueError, TypeError, KeyError):  # cut by max_tokens: the calls begun, as a stream sent them
                return "", [(c.name, c.arguments) for c in scan_calls(text, "parameters", in_array=True) if c.name]
        if self.mode == "auto":
            return hermes.extract_tool_calls(text) or (text, [])
        return text, []

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One choice's stream: the text so far in, the next delta out. A call's first delta carries its index, id,
    type and name (and the arguments so far); later ones its index and more argument text."""

    def __init__(self, tool_calling: ToolCalling):
        self.tools = tool_calling
        self.text = ""
        self.num_content_sent = 0
        self.sent_args: list[str | None] = []
        """Per call: the argument text sent so far (None: the call's first delta is not sent yet)."""

    def delta(self, new_text: str, finish_reason: str | None) -> tuple[DeltaMessage | None, str | None]:
        """The delta for `new_text` (None: nothing to send yet) and the finish_reason to send with it."""
        self.text += new_text
        finished = finish_reason is not None
        content, calls = self._state(finished)
        if finished and self.tools.mode == "auto" and not self.sent_args and not any(call.name for call in calls):
            content, calls = self.text, []  # no call after all: the whole output is content, as when not streamed
        if not self.tools.parallel:
            calls = calls[:1]
        content_delta = content[self.num_content_sent:] if content is not None else ""
        self.num_content_sent += len(content_delta)
        tool_deltas = [d for i, call in enumerate(calls) if (d := self._call_delta(i, call)) is not None]
        reason = _finish_reason(bool(self.sent_args), finish_reason) if finished else None
        if not content_delta and not tool_deltas:
            return (DeltaMessage(content=""), reason) if finished else (None, None)
        return DeltaMessage(content=content_delta or None, tool_calls=tool_deltas), reason

    def _state(self, finished: bool) -> tuple[str | None, list[PartialCall]]:
        if self.tools.mode == "named":
            return None, [PartialCall(name=self.tools.function_name, arguments=self.text)]
        if self.tools.mode == "required":
            return None, scan_calls(self.text, "parameters", in_array=True)
        return hermes.stream_state(self.text, finished)

    def _call_delta(self, index: int, call: PartialCall) -> DeltaToolCall | None:
        if call.name is None:
            return None
        if index == len(self.sent_args):
            self.sent_args.append(call.arguments)
            return DeltaToolCall(index=index, id=random_tool_call_id(), type="function",
                                 function=DeltaFunctionCall(name=call.name, arguments=call.arguments))
        sent = self.sent_args[index]
        if len(call.arguments) <= len(sent) or not call.arguments.startswith(sent):
            return None
        self.sent_args[index] = call.arguments
        return DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=call.arguments[len(sent):]))


def _parameters(tool) -> dict[str, Any]:
    """A tool's `parameters` as its calls must follow them: no parameters is an empty object, and a `strict`
    tool's objects are closed to keys they do not name (OpenAI's strict mode)."""
    parameters = tool.function.parameters
    if parameters is None:
        return {"type": "object", "properties": {}}
    return close_objects(parameters) if tool.function.strict else copy.deepcopy(parameters)


def _check_parameters(tools) -> None:
    """Raises APIError(400) naming the tool whose `parameters` schema is past a bound of bounds.py (checked
    before anything walks it)."""
    for i, tool in enumerate(tools):
        if tool.function.parameters is not None:
            try:
                check_schema(tool.function.parameters)
            except ConstraintLimitError as e:
                raise errors.bad_request(str(e), param=f"tools[{i}].function.parameters") from None


def _finish_reason(called: bool, finish_reason: str | None) -> str | None:
    return "tool_calls" if called and finish_reason != "length" else finish_reason


def _has_output_constraint(request: ChatCompletionRequest) -> bool:
    """structured_outputs, a JSON response_format, or an old guided_* constraint."""
    response_type = request.response_format.type if request.response_format is not None else None
    guided = any(getattr(request, name) is not None for name in GUIDED_ALIASES if name != "guided_whitespace_pattern")
    return request.structured_outputs is not None or response_type not in (None, "text") or guided
