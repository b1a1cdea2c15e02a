"""The value types that cross the package's boundaries, and the wire envelopes between processes.

The bottom layer: it imports no torch and nothing of pagedllm but `sampling_params`, so `core/`, `engine/`,
`worker/`, `layers/` and `metrics/` all import their messages from here and never from each other.

- Frontend (API server or LLM) <-> EngineCore: `EngineCoreRequest`, `EngineCoreOutput(s)`, `FinishReason`,
  `LogprobsEntry`, `SchedulerStats`, `ModelLimits`; on the sockets, wrapped in the envelopes at the bottom
  (`ToEngine`, `FromEngine`).
- ModelRunner -> Scheduler: `ModelRunnerOutput` (plain Python, in process).

Everything that crosses a process is a msgspec.Struct, encoded as msgpack. Nothing is ever pickled.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from pagedllm.pooling_params import PoolerDefaults, PoolingParams
from pagedllm.sampling_params import SamplingParams

MAX_MESSAGE_BYTES = 64 << 20
"""Receive cap on every engine socket (zmq.MAXMSGSIZE): a bigger message drops the connection, not the
process."""


class SpecDecodingStats(msgspec.Struct, kw_only=True):
    """Drafts verified since the last snapshot (vLLM's spec_decode counters)."""

    num_spec_tokens: int = 0
    """Most drafts per request per step (num_speculative_tokens): the length of num_accepted_tokens_per_pos."""
    num_drafts: int = 0
    """Requests that had drafts verified (one per request per step)."""
    num_draft_tokens: int = 0
    """Drafts verified. A constrained request's drafts count after the cut at the first token its grammar refuses
    (the cut ones are never scheduled), as vLLM counts them."""
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []
    """[num_spec_tokens]: drafts accepted at each position of a draft run."""

    @classmethod
    def for_drafts(cls, num_spec_tokens: int | None) -> SpecDecodingStats | None:
        """Zeroed counters for runs of up to num_spec_tokens drafts (None without speculative decoding)."""
        k = num_spec_tokens
        return cls(num_spec_tokens=k, num_accepted_tokens_per_pos=[0] * k) if k else None

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1


class RoutedTokenCounts:
    """A mixture-of-experts model's tokens routed to each expert, summed over the runner's steps until taken."""

    def __init__(self) -> None:
        self.counts: list[int] | None = None

    def add(self, counts: list[int] | None) -> None:
        if counts:
            self.counts = counts if self.counts is None else [a + b for a, b in zip(self.counts, counts, strict=True)]

    def take(self) -> list[int] | None:
        """The sums since the last take (None: no step routed a token)."""
        counts, self.counts = self.counts, None
        return counts


class SchedulerStats(msgspec.Struct, kw_only=True):
    """A snapshot of the scheduler after one step.

    Counters named `*_delta` count events since the previous snapshot (Prometheus counters add them).
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries_delta: int = 0
    """Prompt tokens looked up in the prefix cache since the last snapshot."""
    prefix_cache_hits_delta: int = 0
    """Of those, tokens found cached."""
    num_preemptions_delta: int = 0
    num_slo_shed_delta: int = 0
    """--scheduling-policy slo: requests shed (refused early: their TTFT deadline was out of reach)."""
    spec_decoding_stats: SpecDecodingStats | None = None
    """Speculative decoding counters since the last snapshot; None when speculation is off."""
    grammar_compiles_delta: int = 0
    """Structured outputs: grammars compiled (compile-cache misses) since the last snapshot."""
    grammar_compile_seconds_delta: float = 0.0
    """Their compile time."""
    grammar_cache_hits_delta: int = 0
    """Requests whose grammar came from the compile cache."""
    expert_routed_tokens_delta: list[int] | None = None
    """A mixture-of-experts model: tokens routed to each expert since the last snapshot, summed over its layers (a
    token counts once per layer and per expert it goes to); None for a dense model."""
    external_prefix_cache_queries_delta: int = 0
    """A KV connector: prompt tokens asked of it (past the local prefix hit) since the last snapshot."""
    external_prefix_cache_hits_delta: int = 0
    """Of those, tokens it supplied."""
    kv_connector_stats_delta: dict[str, float] | None = None
    """A KV connector's counters since the last snapshot (Prometheus counter name, or "name|label value" for a
    family of kv_transfer/stats.py, -> value); None without one."""
    total_ref_cnt: int | None = None
    """Sum of every block's ref_cnt (0 when nothing holds a block). Filled only by the debug `stats` utility:
    it walks the whole pool, too slow for every step."""


class FinishReason(enum.IntEnum):
    """Why a request finished. `str()` gives the OpenAI API's `finish_reason`."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """A LoRA adapter a request runs with (vLLM's vllm.lora.request.LoRARequest; also pagedllm.lora.request):
    `lora_name` names it (the prefix cache keys blocks by it), `lora_int_id` (>= 1) identifies its loaded weights
    in the worker, `lora_path` is its PEFT folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError("lora_path cannot be empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


class EngineCoreRequest(msgspec.Struct, kw_only=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    pooling_params: PoolingParams | None = None
    """Set for a pooling request (runner pooling): it runs its prompt, samples nothing (sampling_params is a
    placeholder) and ends with its pooled vector."""
    client_index: int = 0
    """Which API server sent it (--api-server-count > 1): the engine core answers on that server's socket."""
    lora_request: LoRARequest | None = None
    """The adapter the request runs with (None: the base model)."""
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's kv_transfer_params for a KV connector (disaggregated prefill/decode); None: none."""


class LogprobsEntry(msgspec.Struct, array_like=True):
    """Logprobs at one position: token_ids[0]/logprobs[0] is the chosen token (sampled, or the prompt
    token), followed by the top-N tokens by probability. `rank` is the chosen token's rank (1 = best)."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


SLO_UNATTAINABLE = "slo_unattainable"
"""EngineCoreOutput.error_code of a request shed because it can no longer meet its ttft_slo_ms (HTTP 503)."""


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
    pooled: list[float] | None = None
    """A pooling request's result (float32 values), sent with its finish."""
    kv_transfer_params: dict[str, Any] | None = None
    """Sent with its finish by a KV connector's request_finished (a producer: where the consumer pulls from)."""
    error_code: str | None = None
    """With `error`, what kind (None: the engine failed; SLO_UNATTAINABLE: --scheduling-policy slo shed it)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0


@dataclass
class ModelLimits:
    """What the frontend must know of the loaded model to validate requests."""

    vocab_size: int
    max_model_len: int
    eos_token_id: int | None
    extra_stop_token_ids: list[int] = field(default_factory=list)
    """Further EOS ids from generation_config.json; they stop a request like EOS."""
    generation_defaults: dict = field(default_factory=dict)
    """SamplingParams defaults from generation_config.json (vLLM's --generation-config auto)."""
    max_tokens_cap: int | None = None
    """The server caps every request's max_tokens at this (vLLM's override_max_tokens: a --generation-config folder's
    max_new_tokens; under auto the file's max_new_tokens is only the default of a request that sets none)."""
    max_logprobs: int = 20
    """--max-logprobs: the most logprobs (logprobs, top_logprobs, prompt_logprobs) a request may ask for; -1: up to
    the vocabulary."""
    logprobs_are_logits: bool = False
    """--logprobs-mode raw_logits or processed_logits: the `logprob` values are logits (not clamped at 0)."""
    grammar_compile_timeout_s: float = 10.0
    """Structured outputs: a grammar that takes longer to compile is refused (StructuredOutputsConfig)."""
    priority_scheduling: bool = False
    """--scheduling-policy priority: a request's `priority` orders the queue; with fcfs a priority other than 0 is
    refused (vLLM's check)."""
    slo_scheduling: bool = False
    """--scheduling-policy slo: a request may set ttft_slo_ms / tpot_slo_ms (and priority); other policies refuse
    them (vLLM has no such fields, so they are never silently ignored)."""
    json_disable_any_whitespace: bool = True
    json_disable_additional_properties: bool = True
    """Structured outputs: the server's JSON options (StructuredOutputsConfig's disable_any_whitespace and
    disable_additional_properties), so that the frontend checks the grammar the engine will compile."""
    runner_type: str = "generate"
    """--runner resolved: generate (text generation routes) or pooling (embeddings only), as vLLM serves one kind."""
    pooler: PoolerDefaults | None = None
    """runner pooling: the model's pooling (config/pooler.py), which the frontend puts in each PoolingParams."""
    max_lora_rank: int | None = None
    """--enable-lora: the largest adapter rank accepted (None: LoRA off; a request with an adapter is refused)."""
    lora_module_shapes: dict[str, list[int]] = field(default_factory=dict)
    """--enable-lora: each LoRA target module's [in_features, out_features], against which the frontend checks an
    adapter's tensors before any request runs it (lora/peft.py)."""
    num_layers: int = 0
    """The model's decoder layers (an adapter's layer indices are checked against it)."""


@dataclass
class KVConnectorOutput:
    """What a KV connector's worker side reports after a step (vLLM's KVConnectorOutput), summed over the ranks: a
    request is listed once every rank has finished it.

    finished_sending: requests whose blocks the connector no longer reads (their freeing was delayed until now).
    finished_recving: requests whose asynchronous load ended (WAITING_FOR_REMOTE_KVS -> WAITING).
    invalid_block_ids: blocks whose load failed (kv_load_failure_policy decides: recompute or fail the request).
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    kv_connector_stats: dict[str, float] = field(default_factory=dict)
    """The connector's counters since the last report (metric name, or "name|label value" for a family of
    kv_transfer/stats.py, -> value), summed over the ranks."""

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids
                    or self.kv_connector_stats)


@dataclass
class ModelRunnerOutput:
    """What the ModelRunner hands back to the Scheduler after one forward + sample: plain Python, no tensors.

    req_ids: every request scheduled this step, in batch order.
    sampled_token_ids: aligned with req_ids; [] for a request whose prefill chunk did not reach the
        end of its tokens (it samples nothing this step), else the sampled token ids: one, or with
        speculative decoding the accepted drafts and then the target's own token (1 to drafts + 1).
    logprobs: for requests that asked for logprobs and sampled: one entry per sampled token.
    prompt_logprobs: for requests that asked for prompt logprobs: entries for the prompt positions
        computed this step (the first prompt token has None), in order.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, list[LogprobsEntry]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[LogprobsEntry | None]] = field(default_factory=dict)
    spec_token_ids: list[list[int]] | None = None
    """Speculative decoding: aligned with req_ids, the drafts proposed for each request's next step ([]: none);
    None when speculation is off."""
    expert_routed_tokens: list[int] | None = None
    """A mixture-of-experts model: [E] tokens routed to each expert this step, summed over the layers (with
    pipeline parallelism, the last stage's layers); None for a dense model."""
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    """Pooling requests whose prompt ended this step: their pooled (float32) vector."""
    kv_connector_output: KVConnectorOutput | None = None
    """A KV connector's news from the workers (None: no connector)."""

    @property
    def req_id_to_index(self) -> dict[str, int]:
        return {req_id: i for i, req_id in enumerate(self.req_ids)}


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])

# ---- envelopes: API server -> engine core ----------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]



class UtilityCall(msgspec.Struct, tag="utility", array_like=True):
    """"ping" is answered at once by the input thread, with how long the busy loop has been in its current
    step (a long step must not look like a dead engine); the others by the busy loop between steps: "stats",
    and the EngineCore methods of the same names (vLLM's EngineCoreClient utility calls) "reset_prefix_cache",
    "sleep" (args: [level]), "wake_up" (args: the tags; none: all) and "is_sleeping"."""

    call_id: int
    method: Literal["ping", "stats", "reset_prefix_cache", "sleep", "wake_up", "is_sleeping"]
    args: list[int | str] = []
    client_index: int = 0
    """Which API server asks (--api-server-count > 1): the answer goes back on its socket."""


ToEngine = AddRequest | AbortRequests | UtilityCall

# ---- envelopes: engine core -> API server ----------------------------------------------------------------


class Ready(msgspec.Struct, tag="ready", array_like=True):
    num_blocks: int
    block_size: int
    max_model_len: int
    limits: ModelLimits
    """What the frontend validates requests against (vocabulary, context length, EOS, defaults)."""
    model_name: str
    """The model's default served name."""
    pid: int
    cache_config_info: dict[str, str] = msgspec.field(default_factory=dict)
    """Labels of the `vllm:cache_config_info` gauge (EngineCore.cache_config_info)."""


class StartupFailed(msgspec.Struct, tag="startup_failed", array_like=True):
    message: str


class Outputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: EngineCoreOutputs
    num_added: int
    """Requests the engine has taken in so far (rejected ones included)."""


class Rejected(msgspec.Struct, tag="rejected", array_like=True):
    request_id: str
    code: Literal["queue_full", "invalid"]
    message: str


class UtilityResult(msgspec.Struct, tag="utility_result", array_like=True):
    call_id: int
    stats: SchedulerStats | None = None
    step_running_s: float = 0.0
    """For "ping": seconds the busy loop has been in its current step (0.0: between steps or idle)."""
    result: bool | None = None
    """What an EngineCore method returned ("reset_prefix_cache", "wake_up", "is_sleeping")."""
    error: str | None = None
    """The call was refused (the engine's ValueError: a message for the user); nothing changed."""


class EngineFailed(msgspec.Struct, tag="engine_failed", array_like=True):
    message: str


FromEngine = Ready | StartupFailed | Outputs | Rejected | UtilityResult | EngineFailed
