"""What `LLM.generate` returns and the API server streams: vLLM's RequestOutput shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob (the chosen token first, then the top-N).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    """arrival_time, first_scheduled_time, first_token_time, last_token_time (wall-clock seconds)."""
    error: str | None = None
    """Set when the engine failed this request (finish_reason "error"): a message safe to show."""
    error_code: str | None = None
    """What kind of error (messages.EngineCoreOutput.error_code): None, or "slo_unattainable" (shed)."""
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's: what the KV connector returned when the request finished (a P/D producer: where to pull from)."""


@dataclass
class EmbeddingOutput:
    """vLLM's EmbeddingOutput: one embedding (float32 values as Python floats)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns and the embeddings route receives: vLLM's EmbeddingRequestOutput (a
    PoolingRequestOutput whose `outputs` is an EmbeddingOutput)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    prompt: str | None = None
    error: str | None = None
    """Set when the engine failed this request: a message safe to show."""


PoolingRequestOutput = EmbeddingRequestOutput
"""The embed task is the one pooling task run: its outputs are embeddings."""
