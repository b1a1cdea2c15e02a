"""Pydantic models of tool calling in /v1/chat/completions (vLLM's names): the request's `tools` and
`tool_choice`, and the `tool_calls` of a response message or of a stream delta."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_serializer

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel, random_uuid


def random_tool_call_id() -> str:
    """vLLM's tool call id: `chatcmpl-tool-` and 32 hex digits."""
    return f"chatcmpl-tool-{random_uuid()}"


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The JSON schema of the function's arguments (None: no arguments)."""
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str
    """The arguments as JSON text, as OpenAI sends them."""


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=random_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class _NoNulls(OpenAIBaseModel):
    """Serialized without its None fields: the OpenAI SDK merges stream deltas key by key, and an explicit
    `"type": null` in a later fragment would overwrite the call's type."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_NoNulls):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_NoNulls):
    """One fragment of a streamed tool call: the first of each call carries id, type and name (and perhaps the
    start of the arguments), the next ones only `index` and more argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None
