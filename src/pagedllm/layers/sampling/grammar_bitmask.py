"""Structured outputs: a grammar's token bitmask applied to the logits of the rows that sample under it, before
the sampler, so the greedy argmax, penalties, top-k/top-p and logprobs all see only the allowed tokens."""

from __future__ import annotations

import numpy as np
import torch


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: np.ndarray, req_id_to_row: dict[str, int],
                          req_ids: list[str]) -> None:
    """Set to -inf, in place, every token the grammar forbids in the rows of constrained requests.

    Args:
        logits: [N, V] float, row i is req_ids[i]'s.
        bitmask: [M, W] int32; bit t % 32 of word t // 32 of row req_id_to_row[r] set: request r may sample
            token t. Tokens at or past 32 * W are forbidden.
        req_id_to_row: constrained request -> its bitmask row.
        req_ids: the request of each logits row.

    Rows of requests without a grammar are not touched (bitwise unchanged).
    """
    pairs = [(i, req_id_to_row[r]) for i, r in enumerate(req_ids) if r in req_id_to_row]
    if not pairs:
        return
    logit_rows, mask_rows = zip(*pairs, strict=True)
    vocab_size = logits.shape[1]
    words = bitmask[list(mask_rows)]  # [K, W]
    allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]  # [K, <=V] 0/1
    forbidden = torch.ones((len(pairs), vocab_size), dtype=torch.bool)  # [K, V]
    forbidden[:, :allowed.shape[1]] = torch.from_numpy(allowed == 0)
    index = torch.tensor(logit_rows, device=logits.device)
    logits[index] = logits[index].masked_fill(forbidden.to(logits.device), float("-inf"))
