"""The per-step attention metadata and KV caches, reached by every attention layer through a scoped context.

The runner builds one `AttentionMetadata` per step and enters `set_forward_context(metadata, kv_caches)`
around the model's forward; layer i reads `get_forward_context().kv_caches[i]`. Nothing is threaded
through the model's call signature (STYLE habit 6). A model with several KV cache groups (sliding-window layers:
core/kv_cache_spec.py) has one metadata per group, each with its group's block table and slot mapping, and layer i
reads `layer_attn_metadata[i]`; several layers' caches are then the same tensor, used by different groups' blocks.

KV cache layout, per layer: one tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]`,
index 0 = K, 1 = V. Token t of a request lives at slot `block_table[req, t // block_size] * block_size
+ t % block_size`; e.g. with block_size 16 and block table [7, 3], token 20 is slot 3 * 16 + 4 = 52.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Where each request's tokens sit in the flattened batch and in the paged KV cache.

    Example, two requests: A decodes 1 token with 20 tokens of context, B prefills a chunk of 3 tokens
    with 5 already cached. Then T = 4, query_start_loc = [0, 1, 4], seq_lens = [21, 8].
    """

    num_actual_tokens: int  # T: real tokens in the flattened batch (input tensors may be padded past it)
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the model's device
    seq_lens: torch.Tensor  # [num_reqs] int32: context length after this step (computed + scheduled)
    block_table: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    query_start_loc_cpu: np.ndarray  # [num_reqs + 1] host copy of query_start_loc
    seq_lens_cpu: np.ndarray  # [num_reqs] host copy of seq_lens
    verify_reqs: np.ndarray | None = None
    """Requests verifying drafts (speculative decoding): each of their query rows attends like a decode row of its own
    context length (row i of a request with seq_len L and q rows: L - q + 1 + i) over the same block table, so
    their outputs equal plain decoding's bit for bit. None: no such request."""
    # Derived per-step plan, built once by the first attention layer and shared by the others.
    plan: Any = field(default=None, repr=False, compare=False)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    kv_caches: list[torch.Tensor]  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
    layer_attn_metadata: list[AttentionMetadata] | None = None
    """Per layer, its KV cache group's metadata (several groups only; None: every layer reads attn_metadata)."""
    lora_mapping: Any = None
    """This step's LoRA adapters and their rows (lora/layers.py's LoRAMapping); None: no row runs an adapter."""


_forward_context: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata | None, kv_caches: list[torch.Tensor],
    layer_attn_metadata: list[AttentionMetadata] | None = None, lora_mapping: Any = None,
) -> Iterator[ForwardContext]:
    """Make `attn_metadata` and `kv_caches` (and, with several KV cache groups, each layer's metadata) visible to the
    attention layers for one forward pass."""
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(attn_metadata=attn_metadata, kv_caches=kv_caches,
                                      layer_attn_metadata=layer_attn_metadata, lora_mapping=lora_mapping)
    try:
        yield _forward_context
    finally:
        _forward_context = previous


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("no forward context: run the model inside set_forward_context(...)")
    return _forward_context


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of one layer's KV cache: [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]."""
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def kv_cache_bytes_per_block(
    block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, num_layers: int = 1
) -> int:
    """Bytes one KV block takes, K and V, over `num_layers` layers."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * block_size * num_kv_heads * head_dim * itemsize * num_layers
