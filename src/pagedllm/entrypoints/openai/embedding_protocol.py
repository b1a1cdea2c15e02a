"""POST /v1/embeddings: OpenAI's request and response (vLLM's EmbeddingCompletionRequest fields included)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from pagedllm.entrypoints.openai.base_model import OpenAIBaseModel
from pagedllm.entrypoints.openai.protocol import PROMPT_SCHEMA, Int, random_uuid


class EmbeddingRequest(OpenAIBaseModel):
    """OpenAI's fields (input, model, encoding_format, dimensions, user) and vLLM's extras. Every field is honoured,
    or refused with a 400 naming it where a value asks for what is not built
    (tests/entrypoints/test_embeddings_server.py walks them all)."""

    model: str | None = None
    input: Any = Field(..., json_schema_extra=PROMPT_SCHEMA)
    """A string, a list of strings, a list of token ids, or a list of lists of token ids (at most --max-prompts)."""
    encoding_format: str = Field("float", json_schema_extra={"enum": ["float", "base64"]})
    """float: lists of numbers; base64: each embedding's bytes (embed_dtype, endianness; by default little-endian
    float32, what OpenAI's SDK decodes). vLLM's bytes and bytes_only are refused."""
    dimensions: Int | None = None
    """Keep the first `dimensions` values: a matryoshka model only (vLLM's check and message), else a 400."""
    user: str | None = None
    """OpenAI's end-user id: accepted, no effect (as in vLLM)."""
    truncate_prompt_tokens: Int | None = Field(None, json_schema_extra={"minimum": -1})
    """vLLM's: keep this many tokens of each input (-1: max_model_len), cut on `truncation_side`."""
    truncation_side: Literal["left", "right"] | None = None
    """vLLM's: left keeps the last tokens, right (the tokenizer's default) the first."""
    padding: Literal["max_length", "do_not_pad"] | None = None
    """vLLM's: do_not_pad (the default) only; max_length is refused."""
    request_id: str | None = None
    """vLLM's: the response id is `embd-{request_id}`."""
    priority: Int = 0
    """vLLM's: the scheduling priority under --scheduling-policy priority."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """vLLM's multimodal options: refused (text models only)."""
    cache_salt: str | None = None
    """vLLM's: prefix-cache hits only between requests with the same salt."""
    add_special_tokens: bool = True
    """vLLM's: add the tokenizer's special tokens (BOS) to text inputs."""
    embed_dtype: str = Field("float32", json_schema_extra={"enum": ["float32", "float16", "bfloat16"]})
    """vLLM's: the base64 values' dtype; float32, float16 or bfloat16 (fp8 ones are refused)."""
    endianness: Literal["native", "big", "little"] = "native"
    """vLLM's: the base64 values' byte order."""
    use_activation: bool | None = None
    """vLLM's: L2-normalise (default: the model's pooling config, true for an embedding model)."""


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: str = "embedding"
    embedding: list[float] | str


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"embd-{random_uuid()}")
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingResponseData]
    usage: EmbeddingUsage
