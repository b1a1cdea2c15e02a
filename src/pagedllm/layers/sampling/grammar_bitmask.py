"""Structured outputs: a grammar's token bitmask applied to the logits of the rows that sample under it, before
the sampler, so the greedy argmax, penalties, top-k/top-p and logprobs all see only the allowed tokens.

The mask is added as a bias of 0 (allowed) or -inf (forbidden), expanded from the bitmask's bytes through a
256-entry table (`np.take`): on the CPU `masked_fill_` with a boolean mask took 3.7 ms of CPU for 16 rows of
49,152 logits and a float add 0.19 ms; the whole application is ~1.3 ms for 16 rows, ~0.1 ms for one (a loaded
2-core machine). x + 0 is x for every logit (a -0.0 becomes +0.0, which samples the same).
"""

from __future__ import annotations

import numpy as np
import torch

_BYTE_TO_BIAS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"),
                         np.float32(0.0), np.float32(-np.inf)).astype(np.float32)  # [256, 8]: bit i of a byte -> bias


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: np.ndarray, req_id_to_row: dict[str, int],
                          req_ids: list[str], num_rows: list[int] | None = None) -> None:
    """Set to -inf, in place, every token the grammar forbids in the rows of constrained requests.

    Args:
        logits: [N, V] float; request req_ids[i] owns num_rows[i] consecutive rows (one each by default).
        bitmask: [M, W] int32; bit t % 32 of word t // 32 of row req_id_to_row[r] + j set: request r may sample
            token t at its row j. Tokens at or past 32 * W are forbidden.
        req_id_to_row: constrained request -> its first bitmask row.
        req_ids: the request of each (group of) logits rows.
        num_rows: logits rows per request (a request verifying k drafts has k + 1).

    Rows of requests without a grammar are not touched (bitwise unchanged).
    """
    pairs = []  # (logits row, mask row)
    offset = 0
    for i, req_id in enumerate(req_ids):
        n = 1 if num_rows is None else num_rows[i]
        first = req_id_to_row.get(req_id)
        if first is not None:
            pairs.extend((offset + j, first + j) for j in range(n))
        offset += n
    if not pairs:
        return
    logit_rows, mask_rows = zip(*pairs, strict=True)
    vocab_size = logits.shape[1]
    words = np.ascontiguousarray(bitmask[list(mask_rows)])  # [K, W]
    bias = np.take(_BYTE_TO_BIAS, words.view(np.uint8), axis=0).reshape(len(pairs), -1)  # [K, 32 W] (little-endian)
    if bias.shape[1] < vocab_size:
        bias = np.pad(bias, ((0, 0), (0, vocab_size - bias.shape[1])), constant_values=-np.inf)
    bias_t = torch.from_numpy(bias[:, :vocab_size]).to(device=logits.device, dtype=logits.dtype)  # [K, V]
    if len(pairs) == logits.shape[0]:  # every row is constrained (in order): one add
        logits.add_(bias_t)
        return
    for k, i in enumerate(logit_rows):  # in place on each row's view
        logits[i].add_(bias_t[k])
