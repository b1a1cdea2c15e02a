"""SamplingMetadata: the per-step tensors the sampler needs, one row per request that samples this step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Row i describes the request whose logits are row i of the sampler's input.

    Tensors are on the logits' device. Optional tensors are None when no row uses the feature, so the
    sampler skips that pass entirely.
    """

    temperature: torch.Tensor | None
    """[N] float32; 0 for greedy rows. None when every row is greedy."""
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None
    """[N] float32 in (0, 1]; None when every row has top_p == 1."""
    top_k: torch.Tensor | None
    """[N] int64; 0 or -1 = off. None when no row uses top-k."""
    min_p: torch.Tensor | None
    """[N] float32; None when every row has min_p == 0."""
    generators: dict[int, torch.Generator]
    """Row -> the request's own generator (seeded requests that sample randomly)."""
    max_num_logprobs: int | None
    """Largest top-N asked by any row (0 = only the sampled token); None when no row asks."""
    no_penalties: bool
    presence_penalties: torch.Tensor  # [N] float32
    frequency_penalties: torch.Tensor  # [N] float32
    repetition_penalties: torch.Tensor  # [N] float32
    prompt_token_ids: torch.Tensor | None
    """[N, max_prompt_len] int64 padded with vocab_size; only when some row has a repetition penalty."""
    output_token_ids: list[list[int]]
    """Per row, the tokens generated so far (not copied: the caller's lists)."""
    logit_bias: list[dict[int, float] | None]
    min_tokens: dict[int, tuple[int, set[int]]]
    """Row -> (min_tokens, stop token ids incl. EOS) for rows whose output is still below min_tokens."""

    @property
    def num_rows(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_logits_processing(self) -> bool:
        """True when bias, min_tokens or penalties change the raw logits."""
        return not self.no_penalties or bool(self.min_tokens) or any(b for b in self.logit_bias)


def build_sampling_metadata(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    generators: list[torch.Generator | None],
    eos_token_ids: list[int | None],
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """Build one step's metadata from per-row parameters (all lists are aligned with the logits' rows).

    Args:
        params: each row's SamplingParams.
        prompt_token_ids: each row's prompt (read only when a row has a repetition penalty).
        output_token_ids: each row's generated tokens so far (kept by reference, not copied).
        generators: each row's torch.Generator on `device`, or None (unseeded request).
        eos_token_ids: each row's EOS id (blocked by min_tokens unless ignore_eos).
        vocab_size: V, the logits' last dimension; pads prompt_token_ids.
        device: where the tensors go (the logits' device).
    """
    num_rows = len(params)
    temperatures = [p.temperature if not p.greedy else 0.0 for p in params]
    num_greedy = sum(1 for t in temperatures if t == 0.0)
    all_greedy = num_greedy == num_rows
    all_random = num_greedy == 0

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    top_k_values = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
    top_p_values = [p.top_p for p in params]
    min_p_values = [p.min_p for p in params]
    random_rows = [i for i, t in enumerate(temperatures) if t != 0.0]
    use_top_k = any(top_k_values[i] for i in random_rows)
    use_top_p = any(top_p_values[i] < 1.0 for i in random_rows)
    use_min_p = any(min_p_values[i] > 0.0 for i in random_rows)

    presence = [p.presence_penalty for p in params]
    frequency = [p.frequency_penalty for p in params]
    repetition = [p.repetition_penalty for p in params]
    use_repetition = any(r != 1.0 for r in repetition)
    no_penalties = not use_repetition and not any(presence) and not any(frequency)

    prompt_tensor = None
    if use_repetition:
        max_len = max((len(ids) for ids in prompt_token_ids), default=0)
        padded = np.full((num_rows, max_len), vocab_size, dtype=np.int64)  # [N, max_prompt_len]
        for i, ids in enumerate(prompt_token_ids):
            padded[i, : len(ids)] = ids
        prompt_tensor = torch.from_numpy(padded).to(device)

    min_tokens: dict[int, tuple[int, set[int]]] = {}
    for i, p in enumerate(params):
        if p.min_tokens and len(output_token_ids[i]) < p.min_tokens:
            stop_ids = set(p.stop_token_ids)
            if not p.ignore_eos and eos_token_ids[i] is not None:
                stop_ids.add(eos_token_ids[i])
            if stop_ids:
                min_tokens[i] = (p.min_tokens, stop_ids)

    asked = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        temperature=None if all_greedy else tensor(temperatures, torch.float32),
        all_greedy=all_greedy,
        all_random=all_random,
        top_p=tensor(top_p_values, torch.float32) if use_top_p else None,
        top_k=tensor(top_k_values, torch.int64) if use_top_k else None,
        min_p=tensor(min_p_values, torch.float32) if use_min_p else None,
        generators={i: generators[i] for i in random_rows if generators[i] is not None},
        max_num_logprobs=max(asked) if asked else None,
        no_penalties=no_penalties,
        presence_penalties=tensor(presence, torch.float32),
        frequency_penalties=tensor(frequency, torch.float32),
        repetition_penalties=tensor(repetition, torch.float32),
        prompt_token_ids=prompt_tensor,
        output_token_ids=output_token_ids,
        logit_bias=[p.logit_bias or None for p in params],
        min_tokens=min_tokens,
    )
