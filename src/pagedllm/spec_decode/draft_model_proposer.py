"""The draft-model proposer (vLLM's `draft_model` method): a smaller model with the target's vocabulary guesses
the next tokens greedily; the target verifies them as it verifies any other drafts.

Simplification: the draft keeps no KV cache across steps. For each request it recomputes its KV over the
request's whole context (one prefill) in a scratch cache of its own, then takes num_speculative_tokens - 1
greedy decode steps. That costs a prefill of the context per step but needs no bookkeeping of the draft's KV
under preemption, rejection rollback or prefix caching; the scratch cache holds one request of max_model_len
tokens, and the worker takes its bytes out of the KV budget. Requests are drafted one at a time.

Drafts are greedy and carry no probabilities: the rejection sampler treats them with p_draft = 1, which keeps
the target's distribution exactly (passing the draft's softmax for a greedy choice would bias it).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.config import SpeculativeConfig
from pagedllm.layers.forward_context import (
    AttentionMetadata,
    kv_cache_bytes_per_block,
    kv_cache_shape,
    set_forward_context,
)
from pagedllm.math_utils import cdiv


class DraftModelProposer:
    """Args:
        config: num_speculative_tokens is read.
        model: the draft model, loaded like the target (models/loader.py), on `device`.
        max_model_len: the engine's; no draft goes past it (the scheduler would trim it anyway).
    """

    def __init__(self, config: SpeculativeConfig, model: torch.nn.Module, device: torch.device,
                 kv_cache_dtype: torch.dtype, max_model_len: int, block_size: int):
        self.k = config.num_speculative_tokens
        self.model = model
        self.device = device
        self.max_model_len = max_model_len
        self.block_size = block_size
        num_blocks = cdiv(max_model_len, block_size)
        info = model.info
        shape = kv_cache_shape(num_blocks, block_size, model.num_kv_heads, info.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=kv_cache_dtype, device=device) for _ in range(info.num_layers)]
        self.block_table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :]

    @staticmethod
    def scratch_bytes(model_info, num_kv_heads: int, kv_cache_dtype: torch.dtype, max_model_len: int,
                      block_size: int) -> int:
        """Bytes of the scratch KV cache, taken out of the pool's budget."""
        return cdiv(max_model_len, block_size) * kv_cache_bytes_per_block(
            block_size, num_kv_heads, model_info.head_dim, kv_cache_dtype, model_info.num_layers)

    def propose(self, token_ids: np.ndarray, rows: np.ndarray, num_tokens: np.ndarray) -> list[list[int]]:
        """Greedy drafts for the requests in `rows` of the persistent batch's token buffer (the same interface as
        NgramProposer.propose): up to num_speculative_tokens each, none past max_model_len."""
        return [self._propose_one(token_ids[r, :n], min(self.k, self.max_model_len - n))
                for r, n in zip(rows.tolist(), num_tokens.tolist(), strict=True)]

    def _propose_one(self, context: np.ndarray, k: int) -> list[int]:
        if k <= 0:
            return []
        n = len(context)
        drafts = [self._step(torch.from_numpy(context).to(self.device), 0)]  # the context's prefill
        for i in range(1, k):  # then one decode step per further draft, at positions n, n + 1, ...
            drafts.append(self._step(torch.tensor([drafts[-1]], dtype=torch.int64, device=self.device), n + i - 1))
        return drafts

    def _step(self, input_ids: torch.Tensor, start: int) -> int:
        """Run the draft over `input_ids` at positions start.. (the cache holds every position before start);
        returns its argmax after the last one."""
        q = len(input_ids)
        positions = torch.arange(start, start + q, dtype=torch.int64, device=self.device)
        seq_len = start + q
        md = AttentionMetadata(
            num_actual_tokens=q,
            max_query_len=q,
            max_seq_len=seq_len,
            query_start_loc=torch.tensor([0, q], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=self.device),
            block_table=self.block_table[:, :cdiv(seq_len, self.block_size)],
            slot_mapping=positions,  # the block table is the identity: slot = position
            query_start_loc_cpu=np.array([0, q], dtype=np.int64),
            seq_lens_cpu=np.array([seq_len], dtype=np.int64),
        )
        with set_forward_context(md, self.kv_caches):
            hidden_states = self.model(input_ids, positions)
        return int(self.model.compute_logits(hidden_states[-1:]).argmax(dim=-1).item())
