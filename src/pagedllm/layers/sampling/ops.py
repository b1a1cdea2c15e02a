"""Logits processors: vectorized over the batch, Python loops only over rows that carry a bias or min_tokens.

Every function takes logits [N, V] float32 and modifies them in place (and returns them).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.layers.sampling.metadata import SamplingMetadata


def apply_logit_bias(logits: torch.Tensor, logit_bias: list[dict[int, float] | None]) -> torch.Tensor:
    """Add each row's {token id: bias} to its logits with one indexed add."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, bias in enumerate(logit_bias):
        if bias:
            rows.extend([i] * len(bias))
            cols.extend(bias.keys())
            values.extend(bias.values())
    if rows:
        index = (_index(rows, logits.device), _index(cols, logits.device))
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=logits.device),
                          accumulate=True)
    return logits


def apply_min_tokens(logits: torch.Tensor, min_tokens: dict[int, tuple[int, set[int]]]) -> torch.Tensor:
    """Set the stop ids (incl. EOS) of rows still below min_tokens to -inf."""
    rows: list[int] = []
    cols: list[int] = []
    for i, (_, stop_ids) in min_tokens.items():
        rows.extend([i] * len(stop_ids))
        cols.extend(stop_ids)
    if rows:
        logits[_index(rows, logits.device), _index(cols, logits.device)] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """vLLM's penalties, in its order: repetition, then frequency, then presence.

    repetition (prompt + output tokens): positive logits / penalty, negative logits * penalty.
    frequency: logit -= penalty * count in outputs. presence: logit -= penalty * (count > 0).
    """
    num_rows, vocab_size = logits.shape
    output_counts = _output_token_counts(  # [N, V]
        metadata.output_token_ids, num_rows, vocab_size, logits.device)
    output_mask = output_counts > 0  # [N, V]
    repetition = metadata.repetition_penalties  # [N]
    if metadata.prompt_token_ids is not None:
        prompt_mask = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device)
        prompt_mask.scatter_(1, metadata.prompt_token_ids, True)  # padding lands in column V
        seen = prompt_mask[:, :vocab_size] | output_mask  # [N, V]
        penalties = torch.where(seen, repetition.unsqueeze(1), 1.0)  # [N, V]
        logits.copy_(torch.where(logits > 0, logits / penalties, logits * penalties))
    logits -= metadata.frequency_penalties.unsqueeze(1) * output_counts
    logits -= metadata.presence_penalties.unsqueeze(1) * output_mask
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p nucleus.

    top_k [N] (0 or -1 = off), top_p [N] (1 = off). Ties with the k-th logit are kept. The nucleus keeps
    the smallest set of most likely tokens whose mass reaches top_p (always at least the best token).
    """
    vocab_size = logits.shape[1]
    if top_p is None:
        if top_k is None:
            return logits
        return _apply_top_k_only(logits, top_k)
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)  # [N, V] ascending
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)  # [N]
        kth = logits_sort.gather(1, (vocab_size - k).unsqueeze(1))  # [N, 1] the k-th largest logit
        logits_sort.masked_fill_(logits_sort < kth, float("-inf"))
    probs_sum = logits_sort.softmax(dim=-1).cumsum_(dim=-1)  # [N, V] mass of this token and all below
    outside = probs_sum <= (1 - top_p).unsqueeze(1)  # [N, V]
    outside[:, -1] = False
    logits_sort.masked_fill_(outside, float("-inf"))
    return logits.scatter_(1, logits_idx, logits_sort)


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """top-k without a full sort: one topk(max k) finds each row's k-th largest logit."""
    vocab_size = logits.shape[1]
    k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)  # [N]
    max_k = int(k.max())
    if max_k >= vocab_size // 2:
        return apply_top_k_top_p(logits, top_k, torch.ones_like(logits[:, 0]))
    top_values = logits.topk(max_k, dim=-1).values  # [N, max_k] descending
    kth = top_values.gather(1, (k.clamp(max=max_k) - 1).unsqueeze(1))  # [N, 1]
    kth = torch.where((k < vocab_size).unsqueeze(1), kth, float("-inf"))  # rows with top-k off keep all
    return logits.masked_fill_(logits < kth, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p [N] times the row's highest probability."""
    probs = logits.softmax(dim=-1)  # [N, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [N, 1]
    return logits.masked_fill_(probs < threshold, float("-inf"))


def _output_token_counts(output_token_ids: list[list[int]], num_rows: int, vocab_size: int,
                         device: torch.device) -> torch.Tensor:
    """[N, V] float32 count of each token in each row's output, built from one padded tensor."""
    max_len = max((len(ids) for ids in output_token_ids), default=0)
    padded = np.full((num_rows, max_len), vocab_size, dtype=np.int64)  # [N, max_output_len], pad = V
    for i, ids in enumerate(output_token_ids):
        padded[i, : len(ids)] = ids
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=device)
    index = torch.from_numpy(padded).to(device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab_size]


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
