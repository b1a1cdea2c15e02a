"""Token embedding: nn.Embedding whose table may be kept quantized (a GGUF model's token_embd, often Q8_0 and also
the tied LM head); then a lookup decodes just the rows it needs, to the same fp32 values the dequantized table holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers.quantized_weight import PackedWeight


class VocabEmbedding(nn.Embedding):
    """With tensor parallelism (`shard`) the table holds rows [vocab_start, vocab_start + num_embeddings) of the
    vocabulary; ids outside give zeros and the all-reduce over ranks fills them in (vLLM's VocabParallelEmbedding)."""

    quant_weight: PackedWeight | None = None  # the table kept quantized, set by set_quantized_weight
    tp: TensorParallelGroup | None = None  # set by shard (size > 1)
    vocab_start: int = 0

    def shard(self, tp: TensorParallelGroup, vocab_start: int) -> None:
        self.tp, self.vocab_start = tp, vocab_start

    def set_quantized_weight(self, weight: PackedWeight) -> None:
        """Look rows up in `weight` (quantized) instead of a float table, which is dropped."""
        if weight.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"quantized table {list(weight.shape)} for a {self.num_embeddings} x "
                             f"{self.embedding_dim} embedding")
        self.quant_weight = weight
        self.weight = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] int64 -> [T, embedding_dim], a new tensor
        if self.tp is not None:
            local = input_ids - self.vocab_start
            outside = (local < 0) | (local >= self.num_embeddings)
            rows = self._lookup(local.masked_fill(outside, 0))
            return self.tp.all_reduce(rows.masked_fill_(outside.unsqueeze(-1), 0.0))
        return self._lookup(input_ids)

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_weight is not None:
            return self.quant_weight.rows(input_ids)
        return F.embedding(input_ids, self.weight)
