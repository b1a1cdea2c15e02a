"""Pydantic models of the Responses API (POST /v1/responses, GET /v1/responses/{id}): the request, with OpenAI's
fields and vLLM's sampling extras, and the response object with its output items (OpenAI's shapes, which the
`openai` SDK parses). Events of a stream are built in responses_stream.py.

Unlike the other routes, a field this server does not know is a 400 naming it (never dropped silently), and a
known field whose value it cannot honour is a 400 too (serving_responses.py checks those)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import ConfigDict, Field

from pagedllm.engine.input_processor import MAX_CACHE_SALT_LEN
from pagedllm.entrypoints.openai.base_model import OpenAIBaseModel
from pagedllm.entrypoints.openai.protocol import MAX_REQUEST_ID_LEN, Float, Int, random_uuid, range_field


class StrictModel(OpenAIBaseModel):
    """A request part whose unknown fields are refused (HTTP 400 naming the field)."""

    model_config = ConfigDict(extra="forbid")


class FunctionTool(StrictModel):
    """A tool of the request (Responses' flat shape). Only `function` tools exist here; another type (web_search,
    file_search, mcp, ...) is a 400 naming `tools[i].type`."""

    type: str
    name: str | None = Field(None, min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    """`text.format`: text, json_object, or json_schema (name, schema, strict, description), as OpenAI's."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(
        None, description="Only `medium` (the model's own) or null is accepted; another value is a 400.")


class ReasoningConfig(StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="Passed to the chat template as `reasoning_effort` (vLLM's).")
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        None, description="Summaries are not generated here: a value other than null is a 400.")
    generate_summary: Literal["auto", "concise", "detailed"] | None = Field(
        None, description="Deprecated summary: a value other than null is a 400.")


class ResponsesRequest(StrictModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    """A text (one user message), or a list of items: messages (`{role, content}`, content a text or input_text /
    output_text parts), `function_call`, `function_call_output` and `reasoning` items (responses_input.py)."""
    instructions: str | None = None
    max_output_tokens: Int | None = Field(None, json_schema_extra={"minimum": 1})
    temperature: Float | None = range_field(0, 2)
    top_p: Float | None = range_field(maximum=1, exclusive_minimum=0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(None, description="Echoed in the response.")
    user: str | None = Field(None, description="Echoed; it does not change the output.")
    safety_identifier: str | None = Field(None, description="It does not change the output (OpenAI's abuse "
                                                           "monitoring).")
    prompt_cache_key: str | None = Field(None, description="It does not change the output (the prefix cache finds "
                                                          "shared prefixes by itself), as in vLLM.")
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="Echoed; one tier here.")
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = Field(None, description="Only `disabled` (a 400 for a prompt "
                                                                              "too long); `auto` is a 400.")
    background: bool | None = Field(None, description="Not supported: true is a 400.")
    include: list[str] | None = Field(None, description="Not supported: a non-empty list is a 400.")
    max_tool_calls: Int | None = Field(None, description="Not supported: a value is a 400.")
    top_logprobs: Int | None = Field(None, description="Not supported: a value above 0 is a 400.")
    prompt: dict[str, Any] | None = Field(None, description="Prompt templates are not supported: a 400.")
    conversation: str | dict[str, Any] | None = Field(None, description="Conversations are not supported: a 400.")
    stream_options: dict[str, Any] | None = Field(None, description="Not supported: a 400.")
    # vLLM's extras
    top_k: Int | None = Field(None, json_schema_extra={"minimum": -1})
    min_p: Float | None = range_field(0, 1)
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, Float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int = 0
    cache_salt: str | None = Field(None, json_schema_extra={"minLength": 1, "maxLength": MAX_CACHE_SALT_LEN})
    request_id: str | None = Field(None, json_schema_extra={"minLength": 1, "maxLength": MAX_REQUEST_ID_LEN})
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = Field(True, description="vLLM's: false leaves the reasoning item out of the output.")


# ---- the response -------------------------------------------------------------------------------------------


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"msg_{random_uuid()}")
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"rs_{random_uuid()}")
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] | None = "completed"


class FunctionCallItem(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"fc_{random_uuid()}")
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | ReasoningItem | FunctionCallItem


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponsesResponse(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    model: str
    status: Literal["completed", "failed", "in_progress", "incomplete"]
    output: list[OutputItem] = Field(default_factory=list)
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = "auto"
    store: bool = True
    background: bool = False
    temperature: float | None = None
    text: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
