"""SchedulerOutput: what the Scheduler tells the ModelRunner to do this step.

New requests (and requests resuming after preemption) arrive in full, once; requests that were already
running arrive as diffs: the block ids appended this step and their num_computed_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.messages import LoRARequest  # at run time too (the mp executor's broadcast decodes it)
from pagedllm.pooling_params import PoolingParams  # at run time: as SamplingParams
from pagedllm.sampling_params import SamplingParams  # at run time: msgspec decodes it (the mp executor's broadcast)


@dataclass
class NewRequestData:
    """A request the runner has not seen (or dropped at preemption): everything it needs.

    token_ids: prompt + output tokens so far (outputs are non-empty only when resuming).
    block_ids: the request's whole block table (with several KV cache groups, each group's table in turn).
    num_computed_tokens: tokens whose KV is already in those blocks (prefix-cache hits).
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None
    """A pooling request: the runner pools its prompt's hidden states instead of sampling."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter the request runs with (None: the base model); the runner groups rows by it."""


@dataclass
class CachedRequestData:
    """Diffs for requests that ran last step and still run, as parallel lists."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    """Block ids appended to each request's block table this step (often [])."""
    num_computed_tokens: list[int] = field(default_factory=list)
    """Tokens computed BEFORE this step (the step computes num_scheduled_tokens more)."""
    new_token_ids: list[list[int]] = field(default_factory=list)
    """Pipeline parallelism only (else empty): each request's output tokens from max(num_computed_tokens, prompt
    length) to its end. Only the last stage samples; the stages before it learn the sampled tokens here, one step
    later, so no stage waits for another's sampling (the batch queue keeps the stages busy at once)."""

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    """req_id -> tokens to compute this step. Order of keys = batch order."""
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests finished or aborted since the last step: the runner drops their state."""
    preempted_req_ids: set[str] = field(default_factory=set)
    """Requests preempted this step: the runner drops their state; they come back as new requests."""
    step_id: int = 0
    """The scheduler's count of schedule() calls before this one: a step still in flight when one of its requests
    is preempted is known by it (pipeline parallelism keeps several steps in flight)."""
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    """req_id -> draft tokens verified this step (speculative decoding). They are the last len(drafts) of the
    request's num_scheduled_tokens: a decode with 3 drafts schedules 4 tokens (its last token, then the drafts)."""
    kv_connector_metadata: dict | None = None
    """A KV connector's plan for the workers this step (build_connector_meta; None without a connector)."""

    @classmethod
    def empty(cls) -> SchedulerOutput:
        return cls([], CachedRequestData(), {}, 0)
