"""The request fields of structured outputs, on completions and chat alike (as in vLLM): vLLM's `structured_outputs`,
OpenAI's `response_format`, and vLLM's older `guided_*` fields, honoured as aliases of `structured_outputs`.
entrypoints/openai/structured_outputs.py turns them into StructuredOutputsParams."""

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
    disable_fallback: bool = Field(False, description="No fallback to another backend: there is none (llguidance "
                                                      "compiles every request), so true and false behave alike.")
    disable_any_whitespace: bool = Field(False, description="JSON with no free whitespace (the server's default "
                                                            "already, unless its --structured-outputs-config says "
                                                            "disable_any_whitespace false).")
    disable_additional_properties: bool = Field(False, description="Close every object schema that names its "
                                                                   "properties to other keys.")
    whitespace_pattern: str | None = Field(None, description="A regex for the whitespace between JSON tokens.")
    structural_tag: str | None = Field(None, description="Not supported by pagedllm (400).")


class JsonSchemaResponseFormat(OpenAIBaseModel):
    name: str = Field(description="The schema's name (OpenAI's: required, identifies the format; it does not "
                                  "change the output).")
    description: str | None = Field(None, description="What the format is for (OpenAI's; it does not change the "
                                                      "output).")
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="True: every object of the schema is closed to keys it does not "
                                                  "name, as OpenAI's strict mode.")


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's response_format; structural_tag (vLLM's) is known but not supported here (400)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaResponseFormat | None = None


class StructuredOutputFields(OpenAIBaseModel):
    """The structured-output fields of /v1/completions and /v1/chat/completions. A request sets one constraint, in
    one of these fields; the `guided_*` fields (vLLM's before `structured_outputs`) are its aliases."""

    structured_outputs: StructuredOutputsRequest | None = None
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = Field(None, description="Deprecated alias of structured_outputs.json.")
    guided_regex: str | None = Field(None, description="Deprecated alias of structured_outputs.regex.")
    guided_choice: list[str] | None = Field(None, description="Deprecated alias of structured_outputs.choice.")
    guided_grammar: str | None = Field(None, description="Deprecated alias of structured_outputs.grammar.")
    guided_json_object: bool | None = Field(None, description="Deprecated alias of structured_outputs.json_object.")
    guided_whitespace_pattern: str | None = Field(
        None, description="Deprecated alias of structured_outputs.whitespace_pattern.")
    guided_decoding_backend: str | None = Field(
        None, description="Deprecated: the server's backend (auto or guidance) is the only one; another is a 400.")
    structural_tag: str | None = Field(None, description="Deprecated alias of structured_outputs.structural_tag: "
                                                         "not supported by pagedllm (400).")
