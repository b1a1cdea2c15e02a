"""The request fields of structured outputs: vLLM's `structured_outputs` (completions and chat) and OpenAI's
`response_format` (chat). entrypoints/openai/structured_outputs.py turns them into StructuredOutputsParams."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pagedllm.entrypoints.openai.base_model import OpenAIBaseModel


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` request field (its StructuredOutputsParams): one of json, regex, choice, grammar,
    json_object; structural_tag is known but not supported here (400)."""

    json_: str | dict[str, Any] | None = Field(None, alias="json", description="A JSON schema.")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="A Lark or GBNF (EBNF) grammar.")
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = Field(None, description="Not supported by pagedllm (400).")


class JsonSchemaResponseFormat(OpenAIBaseModel):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's response_format; structural_tag (vLLM's) is known but not supported here (400)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaResponseFormat | None = None
