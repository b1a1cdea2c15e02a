"""The sampler: logits [N, V] -> one token per row, plus logprobs when asked (vLLM V1 semantics).

Order of operations:
1. On the raw logits: logit_bias, min_tokens masking (stop ids and EOS -> -inf), then penalties
   (repetition, frequency, presence).
2. Logprobs (when any row asks) are log_softmax of the logits *after* step 1 and *before* temperature,
   top-k, top-p and min-p: what the model plus the request's own adjustments make of each token.
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


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits [N, V] float32 (modified in place) -> SamplerOutput."""
        if metadata.all_greedy and metadata.max_num_logprobs is None and not metadata.needs_logits_processing:
            return SamplerOutput(logits.argmax(dim=-1), None)  # the benchmark's hot path

        if any(b for b in metadata.logit_bias):
            apply_logit_bias(logits, metadata.logit_bias)
        if metadata.min_tokens:
            apply_min_tokens(logits, metadata.min_tokens)
        if not metadata.no_penalties:
            apply_penalties(logits, metadata)

        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = logits.log_softmax(dim=-1)  # [N, V], before temperature and truncation

        sampled = self.sample(logits, metadata)  # [N]
        logprobs_tensors = None
        if logprobs is not None:
            logprobs_tensors = gather_logprobs(logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled, logprobs_tensors)

    @staticmethod
    def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """[N, V] adjusted logits -> [N] int64 token ids."""
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
