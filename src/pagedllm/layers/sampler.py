"""The sampler: logits [N, V] -> one token per row, plus logprobs when asked (vLLM V1 semantics).

Order of operations:
1. On the raw logits: logit_bias, min_tokens masking (stop ids and EOS -> -inf), then penalties
   (repetition, frequency, presence).
2. Logprobs (when any row asks), as vLLM's --logprobs-mode says: raw_logprobs (the default) log_softmax of the
   model's logits before step 1, raw_logits those logits; processed_logprobs / processed_logits the same of the
   logits the tokens are drawn from: after step 1 and, unless every row is greedy, after temperature (1 for a
   greedy row), top-k, top-p and min-p (masked tokens at -inf).
3. Greedy rows (temperature 0): argmax. Random rows: divide by temperature, top-k, top-p, min-p, softmax,
   then one inverse-CDF draw per row (sampling/categorical.py). A seeded row draws its uniform from its own
   generator, so its tokens do not depend on the rest of the batch.

The logits are modified in place. With every row greedy and nothing to adjust, it is one argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers.sampling import categorical
from pagedllm.layers.sampling.logprobs import (
    LogprobsTensors,
    compute_prompt_logprobs,
    gather_logprobs,
    logprobs_to_entries,
)
from pagedllm.layers.sampling.metadata import SamplingMetadata, build_sampling_metadata
from pagedllm.layers.sampling.ops import (
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_top_k_top_p,
)
from pagedllm.sampling_params import GREEDY_TEMPERATURE

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "build_sampling_metadata",
    "compute_prompt_logprobs",
    "logprobs_to_entries",
]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs: LogprobsTensors | None  # sampled token first, then the top max_num_logprobs; None if none asked


LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


class Sampler(nn.Module):
    def __init__(self, logprobs_mode: str = "raw_logprobs"):
        super().__init__()
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}.")
        self.logprobs_mode = logprobs_mode

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits [N, V] float32 (modified in place) -> SamplerOutput."""
        if metadata.all_greedy and metadata.max_num_logprobs is None and not metadata.needs_logits_processing:
            return SamplerOutput(logits.argmax(dim=-1), None)  # the benchmark's hot path

        mode = self.logprobs_mode if metadata.max_num_logprobs is not None else None
        logprobs = None
        if mode == "raw_logprobs":
            logprobs = logits.log_softmax(dim=-1)  # [N, V], before any adjustment
        elif mode == "raw_logits":
            logprobs = logits.clone()

        if any(b for b in metadata.logit_bias):
            apply_logit_bias(logits, metadata.logit_bias)
        if metadata.min_tokens:
            apply_min_tokens(logits, metadata.min_tokens)
        if not metadata.no_penalties:
            apply_penalties(logits, metadata)

        processed = mode is not None and mode.startswith("processed")
        sampled = self.sample(logits, metadata)  # [N]
        if processed:  # the logits the tokens were drawn from (sample() left them in `logits`)
            logprobs = logits.log_softmax(dim=-1) if mode == "processed_logprobs" else logits
        logprobs_tensors = None
        if logprobs is not None:
            logprobs_tensors = gather_logprobs(logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled, logprobs_tensors)

    @staticmethod
    def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """[N, V] adjusted logits -> [N] int64 token ids. The logits are left in place as the draw used them
        (divided by the temperature, 1 on greedy rows, and masked by top-k, top-p and min-p; all greedy:
        untouched), which vLLM's processed logprobs modes return."""
        if metadata.all_greedy:
            return logits.argmax(dim=-1)
        greedy = None if metadata.all_random else logits.argmax(dim=-1)  # [N]
        temperature = metadata.temperature  # [N], 0 on greedy rows
        logits.div_(torch.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature).unsqueeze(1))
        apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        if metadata.min_p is not None:
            apply_min_p(logits, metadata.min_p)
        probs = logits.softmax(dim=-1)  # [N, V]
        random = categorical.draw(probs, categorical.uniforms(probs.shape[0], metadata.generators, probs.device))
        if greedy is None:
            return random
        return torch.where(temperature < GREEDY_TEMPERATURE, greedy, random)
