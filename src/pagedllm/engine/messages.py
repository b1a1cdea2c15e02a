"""Typed messages between the API server (or LLM frontend) and the EngineCore.

Everything here is a msgspec.Struct, encoded as msgpack on the wire. Nothing is ever pickled.
"""

from __future__ import annotations

import enum

import msgspec

from pagedllm.metrics.stats import SchedulerStats
from pagedllm.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request finished. `str()` gives the OpenAI API's `finish_reason`."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, kw_only=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None


class LogprobsEntry(msgspec.Struct, array_like=True):
    """Logprobs at one position: token_ids[0]/logprobs[0] is the chosen token (sampled, or the prompt
    token), followed by the top-N tokens by probability. `rank` is the chosen token's rank (1 = best)."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


class EngineCoreOutput(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    """The stop token id (or stop string, set by the frontend) that finished the request."""
    new_logprobs: list[LogprobsEntry] | None = None
    new_prompt_logprobs: list[LogprobsEntry | None] | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    """Engine-core wall time when the request was first scheduled; sent once, with its first output."""
    error: str | None = None
    """Set with FinishReason.ERROR: what went wrong, safe to show the client."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
