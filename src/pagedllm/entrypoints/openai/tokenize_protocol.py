"""Pydantic models of POST /tokenize and POST /detokenize (vLLM's fields): a prompt, or chat messages with the
fields of /v1/chat/completions that shape the rendered prompt (chat_prompt.py renders both alike)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field, WithJsonSchema

from pagedllm.entrypoints.openai.protocol import MESSAGES_SCHEMA, Int, OpenAIBaseModel
from pagedllm.entrypoints.openai.tool_protocol import ChatCompletionToolsParam


class TokenizeRequest(OpenAIBaseModel):
    model_config = ConfigDict(extra="ignore", json_schema_extra={"oneOf": [{"required": ["prompt"]},
                                                                          {"required": ["messages"]}]})
    model: str | None = None
    prompt: Annotated[str | None, WithJsonSchema({"type": "string"})] = Field(
        None, description="Text to tokenize; give exactly one of prompt and messages.")
    messages: Annotated[list[dict[str, Any]] | None, WithJsonSchema(MESSAGES_SCHEMA)] = None
    add_special_tokens: bool | None = None
    """Default: true for a prompt, false for messages (the chat template writes the special tokens)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    """As in /v1/chat/completions: refused unless --trust-request-chat-template."""
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    """The tools the chat template sees, as /v1/chat/completions hands them to it."""
    return_token_strs: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[Int] = Field(json_schema_extra={"items": {"type": "integer", "minimum": 0}})


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
