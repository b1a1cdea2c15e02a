"""Logprobs: the chosen token's logprob and rank plus the top-N, as tensors and as wire entries."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedllm.messages import LogprobsEntry

# Prompt logprobs are computed over at most this many positions at a time ([rows, V] float32 each).
_PROMPT_LOGPROBS_CHUNK = 512


class LogprobsTensors(NamedTuple):
    logprob_token_ids: torch.Tensor  # [N, 1 + k] int64: the chosen token, then the top-k
    logprobs: torch.Tensor  # [N, 1 + k] float32
    selected_token_ranks: torch.Tensor  # [N] int64: 1 + number of tokens with a strictly higher logprob


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """logprobs [N, V] (log_softmax), token_ids [N] the chosen tokens, num_logprobs = k >= 0."""
    token_ids = token_ids.long().unsqueeze(1)  # [N, 1]
    token_logprobs = logprobs.gather(1, token_ids)  # [N, 1]
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1  # [N]
    if num_logprobs > 0:
        top_values, top_ids = logprobs.topk(num_logprobs, dim=-1)  # [N, k]
        token_ids = torch.cat([token_ids, top_ids], dim=1)
        token_logprobs = torch.cat([token_logprobs, top_values], dim=1)
    return LogprobsTensors(token_ids, token_logprobs, ranks)


def logprobs_to_entries(lp: LogprobsTensors,
                        num_logprobs_per_row: list[int | None]) -> list[LogprobsEntry | None]:
    """One entry per row, trimmed to the 1 + N that row asked for; None where the row asked nothing.

    One .tolist() per tensor for the whole batch.
    """
    token_ids = lp.logprob_token_ids.tolist()
    logprobs = lp.logprobs.tolist()
    ranks = lp.selected_token_ranks.tolist()
    return [
        None if n is None else LogprobsEntry(token_ids[i][: n + 1], logprobs[i][: n + 1], ranks[i])
        for i, n in enumerate(num_logprobs_per_row)
    ]


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor,
                            num_logprobs: int) -> list[LogprobsEntry]:
    """Logprobs of each prompt token given the positions before it.

    Args:
        logits: [M, V] the model's logits at M positions (raw: no penalties, no temperature).
        target_token_ids: [M] the prompt token that follows each position.
        num_logprobs: top-N to return besides the target token.
    Returns: M entries (target first, then the top-N).
    """
    entries: list[LogprobsEntry] = []
    for start in range(0, logits.shape[0], _PROMPT_LOGPROBS_CHUNK):
        chunk = logits[start : start + _PROMPT_LOGPROBS_CHUNK].float().log_softmax(dim=-1)  # [m, V]
        targets = target_token_ids[start : start + _PROMPT_LOGPROBS_CHUNK]  # [m]
        lp = gather_logprobs(chunk, targets, num_logprobs)
        entries.extend(logprobs_to_entries(lp, [num_logprobs] * chunk.shape[0]))
    return entries
