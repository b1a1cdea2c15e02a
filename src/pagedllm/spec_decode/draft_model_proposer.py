"""The draft-model proposer (vLLM's `draft_model` method): a smaller model with the target's vocabulary guesses
the next tokens greedily; the target verifies them as it verifies any other drafts.

Simplification: the draft keeps no KV cache across steps. For each request it recomputes its KV over the
request's whole context (one prefill) in a scratch cache of its own, then takes num_speculative_tokens - 1
greedy decode steps. That costs a prefill of the context per step but needs no bookkeeping of the draft's KV
under preemption, rejection rollback or prefix caching; the scratch cache holds one request of max_model_len
tokens, and the worker takes its bytes out of the KV budget. Requests are drafted together in groups whose
contexts fit that cache side by side (one forward pass per draft position per group).

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
        dtype: the model's; the scratch cache keeps it even under --kv-cache-dtype fp8 (no scales are calibrated
            for the draft, and the cache is small).
        max_model_len: the engine's; no draft goes past it (the scheduler would trim it anyway).
        max_prefill_tokens: the most context tokens one draft forward pass takes (the engine's
            max_num_batched_tokens): a longer context is prefilled in chunks, as the target's would be.
    """

    def __init__(self, config: SpeculativeConfig, model: torch.nn.Module, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, block_size: int, max_prefill_tokens: int):
        self.k = config.num_speculative_tokens
        self.model = model
        self.device = device
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_prefill_tokens = max_prefill_tokens
        self.num_blocks = cdiv(max_model_len, block_size)
        info = model.info
        shape = kv_cache_shape(self.num_blocks, block_size, model.num_kv_heads, info.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(info.num_layers)]

    @staticmethod
    def scratch_bytes(model_info, num_kv_heads: int, dtype: torch.dtype, max_model_len: int, block_size: int) -> int:
        """Bytes of the scratch KV cache, taken out of the pool's budget."""
        return cdiv(max_model_len, block_size) * kv_cache_bytes_per_block(
            block_size, num_kv_heads, model_info.head_dim, dtype, model_info.num_layers)

    def propose(self, token_ids: np.ndarray, rows: np.ndarray, num_tokens: np.ndarray) -> list[list[int]]:
        """Greedy drafts for the requests in `rows` of the persistent batch's token buffer (the same interface as
        NgramProposer.propose): up to num_speculative_tokens each, none past max_model_len. Requests are drafted
        together, in groups whose contexts fit the scratch cache side by side and max_prefill_tokens."""
        drafts: list[list[int]] = [[] for _ in rows]
        ks = np.minimum(self.k, self.max_model_len - num_tokens)  # [R] drafts each request gets
        blocks = cdiv(num_tokens + ks - 1, self.block_size)  # [R] scratch blocks: context and all but the last draft
        group: list[int] = []
        used = tokens = 0
        for i in np.flatnonzero(ks > 0).tolist():
            if group and (used + blocks[i] > self.num_blocks or tokens + num_tokens[i] > self.max_prefill_tokens):
                self._propose_group(token_ids, rows, num_tokens, ks, blocks, group, drafts)
                group, used, tokens = [], 0, 0
            group.append(i)
            used += int(blocks[i])
            tokens += int(num_tokens[i])
        if group:
            self._propose_group(token_ids, rows, num_tokens, ks, blocks, group, drafts)
        return drafts

    def _propose_group(self, token_ids: np.ndarray, rows: np.ndarray, num_tokens: np.ndarray, ks: np.ndarray,
                       blocks: np.ndarray, group: list[int], drafts: list[list[int]]) -> None:
        """One prefill over every context of the group (in chunks of max_prefill_tokens for a request alone in
        its group), then one decode step per further draft (requests that want fewer drafts drop out). Request
        j's scratch blocks are first[j] .. first[j] + blocks[j] - 1.

        Example, block_size 16, contexts of 20 and 5 tokens, 3 drafts: blocks [2, 1], first [0, 2]; the prefill
        writes slots 0..19 and 32..36; the decode steps write positions 20, 21 and 5, 6."""
        bs = self.block_size
        g = np.asarray(group)
        n, k, nb = num_tokens[g], ks[g], blocks[g]  # [G] each
        first = np.concatenate([[0], np.cumsum(nb)[:-1]])  # [G]
        # [G, max blocks]; past a request's own blocks the ids are never attended to, only kept in range
        block_table = np.minimum(first[:, None] + np.arange(int(nb.max()))[None, :], self.num_blocks - 1)
        if len(group) == 1:
            row, c, chunk = int(rows[g[0]]), int(n[0]), self.max_prefill_tokens
            for start in range(0, c, chunk):
                pos = np.arange(start, min(c, start + chunk))
                last = self._step(token_ids[row, pos], pos, pos, np.array([len(pos)]), block_table)  # [1]
        else:
            positions = np.concatenate([np.arange(c) for c in n.tolist()])
            input_ids = np.concatenate([token_ids[r, :c] for r, c in zip(rows[g].tolist(), n.tolist(), strict=True)])
            last = self._step(input_ids, positions, np.repeat(first, n) * bs + positions, n, block_table)  # [G]
        for j, token in enumerate(last.tolist()):
            drafts[group[j]].append(token)
        for i in range(1, int(k.max())):  # draft i + 1 from draft i, at position n + i - 1
            active = np.flatnonzero(k > i)
            pos = n[active] + i - 1
            tokens = self._step(last[active], pos, first[active] * bs + pos, np.ones(len(active), dtype=np.int64),
                                block_table[active])
            last[active] = tokens
            for j, token in zip(active.tolist(), tokens.tolist(), strict=True):
                drafts[group[j]].append(token)

    def _step(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, query_lens: np.ndarray,
              block_table: np.ndarray) -> np.ndarray:
        """Run the draft over the flattened queries (each request's cache holds every position before its
        first); returns each request's argmax after its last query token."""
        dev = self.device
        query_start_loc = np.concatenate([[0], np.cumsum(query_lens)])
        seq_lens = positions[query_start_loc[1:] - 1] + 1
        md = AttentionMetadata(
            num_actual_tokens=len(input_ids),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_table=torch.from_numpy(np.ascontiguousarray(block_table, dtype=np.int32)).to(dev),
            slot_mapping=torch.from_numpy(slots.astype(np.int64)).to(dev),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        positions_t = torch.from_numpy(positions.astype(np.int64)).to(dev)
        with set_forward_context(md, self.kv_caches):
            hidden_states = self.model(torch.from_numpy(input_ids.astype(np.int64)).to(dev), positions_t)
        last = torch.from_numpy(query_start_loc[1:] - 1).to(dev)
        return self.model.compute_logits(hidden_states[last]).argmax(dim=-1).cpu().numpy()
