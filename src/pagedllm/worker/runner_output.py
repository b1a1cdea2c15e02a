"""What the ModelRunner hands back to the Scheduler after one step: plain Python, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.engine.messages import LogprobsEntry


@dataclass
class ModelRunnerOutput:
    """The result of one forward + sample.

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

    @property
    def req_id_to_index(self) -> dict[str, int]:
        return {req_id: i for i, req_id in enumerate(self.req_ids)}


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
