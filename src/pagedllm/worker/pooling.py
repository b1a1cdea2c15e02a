"""Pooling in the runner: a pooling request's final-norm hidden states become one vector when its prompt is done.

vLLM's poolers for decoder models: LAST (the last prompt token's hidden state), MEAN (the mean over every prompt
token) and CLS (the first token's); then vLLM's embed head: the first `dimensions` values (matryoshka), then L2
normalisation when `use_activation`. Unlike vLLM, which turns chunked prefill off for MEAN and CLS, a prompt may
be chunked: each chunk's rows are kept (MEAN: every row, CLS: the first) and pooled once the last chunk ran, so the
vector has the bits it has when the prompt runs in one step (a row's hidden state does not depend on the chunking
or the batch). MEAN and CLS requests never read the prefix cache (their PoolingParams say so), since a cached block
would skip rows they need; LAST needs only the last row, which is always recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.pooling_params import PoolingParams


@dataclass
class _Pooling:
    params: PoolingParams
    num_prompt_tokens: int
    rows: list[torch.Tensor] = field(default_factory=list)
    """MEAN: every chunk's rows so far; CLS: the first row."""


class Pooler:
    """The pooling requests the runner holds, by id (added with the batch's new requests, dropped with them)."""

    def __init__(self) -> None:
        self.requests: dict[str, _Pooling] = {}

    def add(self, req_id: str, params: PoolingParams, num_prompt_tokens: int) -> None:
        self.requests[req_id] = _Pooling(params, num_prompt_tokens)

    def drop(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def is_pooling(self, req_id: str) -> bool:
        return req_id in self.requests

    def collect(self, req_ids: list[str], num_computed: np.ndarray, num_sched: np.ndarray,
                query_start_loc: np.ndarray, hidden_states: torch.Tensor) -> dict[str, list[float]]:
        """Take this step's rows of every pooling request; returns the vectors of those whose prompt ended.

        num_computed: [R] tokens each request had computed before this step; query_start_loc: [R + 1] their rows."""
        result: dict[str, list[float]] = {}
        for i, req_id in enumerate(req_ids):
            state = self.requests.get(req_id)
            if state is None:
                continue
            start, n, done = int(query_start_loc[i]), int(num_sched[i]), int(num_computed[i])
            kind = state.params.pooling_type or "LAST"
            if kind == "MEAN" or (kind == "CLS" and done == 0):
                if done != sum(len(r) for r in state.rows):
                    raise RuntimeError(f"{kind} pooling of request {req_id!r} misses prompt rows (a prefix-cache "
                                       "hit?)")
                rows = hidden_states[start:start + n] if kind == "MEAN" else hidden_states[start:start + 1]
                state.rows.append(rows.to(torch.float32, copy=True))
            if done + n < state.num_prompt_tokens:
                continue
            if kind == "LAST":
                vector = hidden_states[start + n - 1].to(torch.float32)
            elif kind == "CLS":
                vector = state.rows[0][0]
            else:
                vector = torch.cat(state.rows).mean(dim=0)
            result[req_id] = embed_head(vector, state.params).tolist()
            del self.requests[req_id]
        return result


def embed_head(vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """vLLM's EmbeddingPoolerHead: the first `dimensions` values, then L2 normalisation when use_activation."""
    if params.dimensions is not None:
        vector = vector[:params.dimensions]
    if params.use_activation is None or params.use_activation:
        vector = torch.nn.functional.normalize(vector, p=2, dim=-1)
    return vector
