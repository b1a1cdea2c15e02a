"""Pydantic models of the OpenAI-compatible HTTP API (requests and responses), vLLM's extra fields included.

Unknown request fields are ignored, as OpenAI-compatible servers do. Ranges that depend on the loaded
model (vocabulary, context length) are checked later, by the InputProcessor.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, WithJsonSchema, field_validator
from pydantic_core import PydanticCustomError

from pagedllm.engine.input_processor import MAX_CACHE_SALT_LEN
from pagedllm.entrypoints.openai.base_model import OpenAIBaseModel
from pagedllm.entrypoints.openai.structured_outputs_protocol import StructuredOutputFields

MAX_REQUEST_ID_LEN = 256


def random_uuid() -> str:
    return uuid.uuid4().hex




def _not_a_bool(kind: str):
    """JSON `true` is not the number 1: pydantic's lax int and float take it, OpenAI's API rejects it."""

    def check(value: Any) -> Any:
        if isinstance(value, bool):
            raise PydanticCustomError(f"{kind}_type", f"Input should be {'an' if kind == 'int' else 'a'} "
                                      f"{'integer' if kind == 'int' else 'number'}, not a boolean")
        return value

    return BeforeValidator(check)


Int = Annotated[int, _not_a_bool("int")]
"""An integer field: lax as vLLM's (`"16"` and `16.0` are 16) except that a boolean is rejected."""
Float = Annotated[float, _not_a_bool("float")]
"""A number field: lax as vLLM's except that a boolean is rejected."""


def range_field(minimum: float | None = None, maximum: float | None = None, exclusive_minimum: float | None = None,
           description: str | None = None) -> Any:
    """A field's documented range, in the OpenAPI schema only: the server checks ranges itself (SamplingParams,
    InputProcessor), with messages that name the parameter."""
    extra = {k: v for k, v in (("minimum", minimum), ("maximum", maximum), ("exclusiveMinimum", exclusive_minimum))
             if v is not None}
    return Field(None, json_schema_extra=extra or None, description=description)


_TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        _TOKEN_IDS_SCHEMA,
        {"type": "array", "items": _TOKEN_IDS_SCHEMA, "minItems": 1},
    ],
    "description": "A string, a list of strings, a list of token ids, or a list of lists of token ids (at most "
                   "--max-prompts prompts).",
}
_CONTENT_PART_SCHEMA = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                        "required": ["type", "text"]}
MESSAGES_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "properties": {
            "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _CONTENT_PART_SCHEMA},
                                  {"type": "null"}]},
            "name": {"type": "string"},
        },
        "required": ["role"],
    },
    "description": "The conversation, rendered by the model's chat template. Content is a string or a list of "
                   "text parts.",
}


# ---- errors -------------------------------------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---- shared request parts ---------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = Field(False, description="A last chunk with the usage of the whole request.")
    continuous_usage_stats: bool | None = Field(False, description="vLLM's: every chunk carries the usage so far.")


class SamplingFields(StructuredOutputFields):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extras; the structured-output
    ones in StructuredOutputFields)."""

    model: str | None = None
    n: Int | None = Field(1, description="Choices per prompt (at most --max-n); null means 1.",
                          json_schema_extra={"minimum": 1})
    temperature: Float | None = range_field(0, 2)
    top_p: Float | None = range_field(maximum=1, exclusive_minimum=0)
    presence_penalty: Float | None = Field(0.0, json_schema_extra={"minimum": -2, "maximum": 2})
    frequency_penalty: Float | None = Field(0.0, json_schema_extra={"minimum": -2, "maximum": 2})
    seed: Int | None = None
    stop: str | list[str] | None = Field(None, description="Stop strings (at most --max-stop).")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Float] | None = Field(
        None, description="Token id (as a string) to a bias in [-100, 100] (at most --max-logit-bias entries).")
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: Int | None = Field(None, description="-1 or 0 disables; else at least 1.",
                              json_schema_extra={"minimum": -1})
    min_p: Float | None = range_field(0, 1)
    repetition_penalty: Float | None = range_field(maximum=2, exclusive_minimum=0)
    ignore_eos: bool = False
    min_tokens: Int = Field(0, json_schema_extra={"minimum": 0})
    stop_token_ids: list[Int] | None = Field(None, description="At most --max-stop ids.")
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int = 0
    ttft_slo_ms: Float | None = range_field(exclusive_minimum=0, description="pagedllm's, with --scheduling-policy "
                                            "slo only: time-to-first-token deadline in ms after arrival; a request "
                                            "that can no longer meet it is refused (503, slo_unattainable).")
    tpot_slo_ms: Float | None = range_field(exclusive_minimum=0, description="pagedllm's, with --scheduling-policy "
                                            "slo only: time per output token in ms (the deadline of later tokens).")
    cache_salt: str | None = Field(None, description=f"Prefix-cache isolation key (1 to {MAX_CACHE_SALT_LEN} "
                                   "characters).", json_schema_extra={"minLength": 1, "maxLength": MAX_CACHE_SALT_LEN})
    request_id: str | None = Field(None, json_schema_extra={"minLength": 1, "maxLength": MAX_REQUEST_ID_LEN})
    return_token_ids: bool | None = False
    return_tokens_as_token_ids: bool | None = Field(None, description="Name logprobs' tokens `token_id:N` "
                                                    "(vLLM's); default: the server's --return-tokens-as-token-ids.")
    add_special_tokens: bool | None = None
    prompt_logprobs: Int | None = range_field(0, 20, description="Top-N logprobs of every prompt token (vLLM's); "
                                                            "not with stream=true.")
    kv_transfer_params: dict[str, Any] | None = Field(
        None, description="vLLM's KV transfer parameters for disaggregated prefill/decode (a JSON object passed to "
        "the server's KV connector, e.g. {\"do_remote_decode\": true} to a producer, or a producer's answer to a "
        "consumer); ignored without --kv-transfer-config, as in vLLM.")

    @field_validator("n", mode="after")
    @classmethod
    def _n_default(cls, value: int | None) -> int:
        return 1 if value is None else value


# ---- /v1/completions ------------------------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    prompt: Annotated[str | list[Any], WithJsonSchema(PROMPT_SCHEMA)]
    """A string, a list of strings, a list of token ids, or a list of lists of token ids. The list's items
    are checked by the server after the cap on their number (a union here would validate 100,000 items
    several times before any cap could apply); the OpenAPI schema documents the four shapes."""
    max_tokens: Int | None = Field(16, json_schema_extra={"minimum": 1})
    echo: bool | None = False
    logprobs: Int | None = range_field(0, 20)
    suffix: str | None = None
    best_of: Int | None = None


class Logprob(OpenAIBaseModel):
    """One token's entry at one prompt position (vLLM's prompt_logprobs)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, Logprob] | None]
"""vLLM's prompt_logprobs: per prompt token, None for the first, then token id -> Logprob (the prompt token and
the top-N)."""


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's: what the KV connector returned when the request finished (a P/D producer: where the consumer
    pulls the prompt's KV from); null without one."""


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---- models, tokenize, detokenize -----------------------------------------------------------------------


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
