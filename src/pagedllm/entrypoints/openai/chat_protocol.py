"""Pydantic models of POST /v1/chat/completions (request, response, stream chunks); the shared parts are in
protocol.py."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field, WithJsonSchema

from pagedllm.entrypoints.openai.protocol import (
    MESSAGES_SCHEMA,
    Int,
    OpenAIBaseModel,
    PromptLogprobs,
    SamplingFields,
    UsageInfo,
    random_uuid,
    range_field,
)
from pagedllm.entrypoints.openai.tool_protocol import ChatCompletionToolsParam, DeltaToolCall, ToolCall, ToolChoice


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[dict[str, Any]], WithJsonSchema(MESSAGES_SCHEMA)]
    max_tokens: Int | None = Field(None, json_schema_extra={"minimum": 1},
                                   description="Deprecated by OpenAI for max_completion_tokens (which wins).")
    max_completion_tokens: Int | None = Field(None, json_schema_extra={"minimum": 1})
    logprobs: bool | None = False
    top_logprobs: Int | None = range_field(0, 20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: ToolChoice | None = None
    """none, auto, required or {"type": "function", "function": {"name": ...}}; default: auto with tools, else none."""
    parallel_tool_calls: bool | None = True


def _absent_if_none(value) -> bool:
    return value is None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    reasoning: str | None = Field(None, exclude_if=_absent_if_none)
    """The reasoning split out by --reasoning-parser (vLLM 0.32's name); absent without a parser."""
    reasoning_content: str | None = Field(None, exclude_if=_absent_if_none)
    """The same text under vLLM's older name, which clients still read."""
    tool_calls: list[ToolCall] = Field(default_factory=list, exclude_if=lambda calls: not calls)  # absent, as in vLLM


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = Field(None, exclude_if=_absent_if_none)
    reasoning_content: str | None = Field(None, exclude_if=_absent_if_none)
    tool_calls: list[DeltaToolCall] = Field(default_factory=list, exclude_if=lambda calls: not calls)


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIBaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's: what the KV connector returned when the request finished (protocol.py's CompletionResponse)."""


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
