"""A minimal paged model runner for tests: block tables, slot mapping and metadata for one step.

Blocks are handed out in a shuffled order so a wrong block-table read cannot pass by accident.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.layers.forward_context import AttentionMetadata, kv_cache_shape, set_forward_context


class PagedRunner:
    def __init__(self, model, num_blocks: int = 64, block_size: int = 16, seed: int = 0, native_step=None,
                 kv_dtype: torch.dtype | None = None):
        """native_step: a LlamaNativeDecodeStep run first, as the model runner does (the model's modules run the
        steps it declines); kv_dtype: the KV cache's storage dtype (default the model's)."""
        info = model.info
        self.model = model
        self.native_step = native_step
        self.native_steps = 0  # steps the native step ran
        self.block_size = block_size
        norm = model.model.norm.weight  # the embedding table may be kept quantized (no .weight)
        dtype, device = norm.dtype, norm.device
        self.device = device
        shape = kv_cache_shape(num_blocks, block_size, info.num_kv_heads, info.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=kv_dtype or dtype, device=device) for _ in range(info.num_layers)]
        self.free_blocks = list(np.random.default_rng(seed).permutation(num_blocks))
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def step(self, chunks: list[tuple[str, list[int]]]) -> torch.Tensor:
        """Run one flattened step: each (req_id, new token ids) continues that request.

        Returns float32 logits [T, vocab] for every token of the step.
        """
        input_ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
        for req_id, tokens in chunks:
            start = self.num_computed.get(req_id, 0)
            table = self.block_tables.setdefault(req_id, [])
            end = start + len(tokens)
            while len(table) * self.block_size < end:
                table.append(int(self.free_blocks.pop()))
            for pos in range(start, end):
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            input_ids += tokens
            positions += range(start, end)
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(end)
            self.num_computed[req_id] = end
        width = max(len(self.block_tables[r]) for r, _ in chunks)
        block_table = np.zeros((len(chunks), width), dtype=np.int32)
        for i, (req_id, _) in enumerate(chunks):
            block_table[i, : len(self.block_tables[req_id])] = self.block_tables[req_id]
        qsl_np, seq_np = np.array(qsl, dtype=np.int32), np.array(seq_lens, dtype=np.int32)
        md = AttentionMetadata(
            num_actual_tokens=len(input_ids),
            max_query_len=int(max(np.diff(qsl_np))),
            max_seq_len=int(seq_np.max()),
            query_start_loc=torch.from_numpy(qsl_np).to(self.device),
            seq_lens=torch.from_numpy(seq_np).to(self.device),
            block_table=torch.from_numpy(block_table).to(self.device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            query_start_loc_cpu=qsl_np,
            seq_lens_cpu=seq_np,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        with torch.inference_mode(), set_forward_context(md, self.kv_caches):
            hidden = None if self.native_step is None else self.native_step.forward(ids, pos)
            if hidden is None:
                hidden = self.model(ids, pos)  # [T, hidden]
            else:
                self.native_steps += 1
            return self.model.compute_logits(hidden)  # [T, vocab]
