"""Request: the engine core's state for one request, and its lifecycle status."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedllm.core.block_hash import BlockHash, append_block_hashes
from pagedllm.messages import FinishReason

if TYPE_CHECKING:
    from pagedllm.messages import EngineCoreRequest, LoRARequest
    from pagedllm.pooling_params import PoolingParams
    from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Where a request is. Every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()
    """Waiting for its grammar to compile (structured outputs); then WAITING."""
    WAITING_FOR_REMOTE_KVS = enum.auto()
    """Waiting for a KV connector's asynchronous load into its blocks (core/kv_connector.py); then WAITING."""
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    def __str__(self) -> str:
        return self.name

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        """The wire FinishReason for a finished status, else None."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """One request inside the engine core.

    `all_token_ids` is prompt + outputs; `num_computed_tokens` of them have KV in the cache.
    `block_hashes` holds one hash per full block of `all_token_ids`, extended as tokens arrive.

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt (non-empty).
        sampling_params: how to sample and when to stop.
        eos_token_id: the tokenizer's EOS id, or None.
        arrival_time: wall time the request arrived (orders fcfs and breaks priority ties).
        block_size: KV block size, for the prefix-cache hashes.
        priority: lower runs first under the priority policy.
        cache_salt: prefix-cache namespace; only requests with the same salt share blocks.
        pooling_params: set for a pooling request (an embedding).
        lora_request: the LoRA adapter it runs with (None: the base model); only requests of the same adapter
            share blocks.
        kv_transfer_params: the request's kv_transfer_params for a KV connector (None: none).
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_id", "arrival_time", "priority",
        "cache_salt", "block_size", "output_token_ids", "all_token_ids", "num_computed_tokens",
        "num_cached_tokens", "status", "stop_reason", "block_hashes", "num_preemptions",
        "preempted_at_step", "first_scheduled_time", "first_output_sent", "max_tokens", "_stop_token_ids",
        "spec_token_ids", "spec_acceptance", "structured_output_request", "pooling_params",
        "num_output_placeholders", "lora_request", "lora_name", "kv_transfer_params",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float,
        block_size: int,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        kv_transfer_params: dict | None = None,
    ):
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt.")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}.")
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.pooling_params = pooling_params
        """A pooling request's parameters (None: it generates): it finishes when its prompt is computed."""
        self.lora_request = lora_request
        self.lora_name = None if lora_request is None else lora_request.lora_name
        """The adapter's name, a prefix-cache key (None: the base model)."""
        self.kv_transfer_params = kv_transfer_params
        """What the client sent for a KV connector (disaggregated prefill/decode: do_remote_decode, or the producer's
        remote_* fields for a consumer); None: nothing."""
        self.block_size = block_size
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        """--async-scheduling: tokens that steps in flight will sample for it (counted in num_computed_tokens, not
        yet in all_token_ids); always 0 without it (core/async_scheduler.py)."""
        self.num_cached_tokens = 0
        """Prompt tokens found in the prefix cache when the request was first scheduled."""
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[BlockHash] = []
        self.num_preemptions = 0
        self.preempted_at_step = -1
        """The step_id of the schedule() that last preempted it (the outputs of steps before it are stale)."""
        self.first_scheduled_time: float | None = None
        self.first_output_sent = False
        """Whether an EngineCoreOutput went out (first_scheduled_time rides on the first one)."""
        self.max_tokens = sampling_params.max_tokens
        self.spec_token_ids: list[int] = []
        """Draft tokens the proposer guessed after the last step (under a grammar, only the prefix it allows),
        verified (in part) by the next one."""
        self.spec_acceptance = None
        """core.acceptance_guard.DraftAcceptance: its recent draft acceptance (set by the scheduler when
        speculating)."""
        self._stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.structured_output_request = None
        """structured_output.StructuredOutputRequest when the output must match a grammar (set by the engine core,
        which puts the request in WAITING_FOR_FSM): `is_ready()`, `accept_tokens(token_ids)`,
        `validate_tokens(draft_token_ids)`."""
        append_block_hashes(self.block_hashes, self.all_token_ids, block_size, cache_salt, self.lora_name)

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest, block_size: int) -> Request:
        """Build from the wire message.

        Args:
            req: the request as the frontend sent it.
            block_size: KV block size (CacheConfig.block_size).

        Returns:
            A WAITING Request with its prompt's block hashes computed.
        """
        return cls(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            eos_token_id=req.eos_token_id,
            arrival_time=req.arrival_time,
            block_size=block_size,
            priority=req.priority,
            cache_salt=req.cache_salt,
            pooling_params=req.pooling_params,
            lora_request=req.lora_request,
            kv_transfer_params=req.kv_transfer_params,
        )

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Every prompt position must be computed: prompt logprobs (as vLLM does), or MEAN / CLS pooling."""
        return self.sampling_params.prompt_logprobs is not None or (
            self.pooling_params is not None and self.pooling_params.skip_reading_prefix_cache)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def is_stop_token(self, token_id: int) -> bool:
        """Whether `token_id` is one of sampling_params.stop_token_ids."""
        return token_id in self._stop_token_ids

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append sampled tokens and hash any block they complete.

        Args:
            token_ids: one token id or several.
        """
        if isinstance(token_ids, int):
            self.append_output_token_id(token_ids)
            return
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if len(self.all_token_ids) >= (len(self.block_hashes) + 1) * self.block_size:
            append_block_hashes(self.block_hashes, self.all_token_ids, self.block_size, self.cache_salt,
                                    self.lora_name)

    def append_output_token_id(self, token_id: int) -> None:
        """Append one sampled token (the decode hot path) and hash the block it completes, if any."""
        self.output_token_ids.append(token_id)
        all_token_ids = self.all_token_ids
        all_token_ids.append(token_id)
        if len(all_token_ids) % self.block_size == 0:
            append_block_hashes(self.block_hashes, all_token_ids, self.block_size, self.cache_salt, self.lora_name)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
