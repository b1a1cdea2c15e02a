"""PoolingParams: what a pooling request (an embedding) asks of the engine, with vLLM's names; and PoolerDefaults,
the pooling the loaded model does unless a request says otherwise (the engine core resolves it, config/pooler.py).

A pooling request runs its prompt once (prefill only, chunked like any other), samples nothing, and ends with
one vector: the final-norm hidden states pooled (LAST token, MEAN of all tokens, or CLS: the first), cut to
`dimensions` (matryoshka models) and then L2-normalised when `use_activation` (vLLM's order).
"""

from __future__ import annotations

import msgspec

SEQ_POOLING_TYPES = ("LAST", "MEAN", "CLS")
"""vLLM's sequence pooling types (config/pooler.py SequencePoolingType)."""


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's PoolingParams for the embed task."""

    use_activation: bool | None = None
    """L2-normalise the embedding (vLLM's `use_activation`, formerly `normalize`). None: the model's default
    (True for embed, or what its sentence-transformers Normalize module says)."""
    dimensions: int | None = None
    """Keep the first `dimensions` values (a matryoshka model only); None: all."""
    task: str = "embed"
    """The pooling task; only "embed" is run."""
    pooling_type: str | None = None
    """Internal, filled by the frontend from PoolerDefaults: LAST, MEAN or CLS."""
    skip_reading_prefix_cache: bool = False
    """Internal: the prompt is computed whole, without prefix-cache hits (MEAN and CLS need every prompt token's
    hidden state, or the first one's, which a cached block would skip)."""


class PoolerDefaults(msgspec.Struct, kw_only=True):
    """The loaded model's pooling, sent to the frontend in ModelLimits (runner `pooling` only)."""

    pooling_type: str = "LAST"
    use_activation: bool = True
    embedding_size: int = 0
    """Length of an embedding (the hidden size)."""
    is_matryoshka: bool = False
    """config.json's is_matryoshka, or a matryoshka_dimensions list: `dimensions` is allowed."""
    matryoshka_dimensions: list[int] | None = None
    dimensions: int | None = None
    """--pooler-config's dimensions: the default of a request that sets none."""
