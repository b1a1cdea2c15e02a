"""Fixtures of the offline-LLM tests: one factory for engines on a test model."""

from __future__ import annotations

import pytest

from pagedllm import LLM


def _make_llm(model, draft=None, **kwargs) -> LLM:
    """LLM(model) in float32 with max_model_len 256 and a pool of 256 blocks unless kwargs say otherwise;
    `draft`: a draft model's folder, speculating 3 tokens (speculative_config method draft_model)."""
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("max_model_len", 256)
    kwargs.setdefault("num_gpu_blocks_override", 256)
    if draft is not None:
        kwargs["speculative_config"] = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    return LLM(str(model), **kwargs)


@pytest.fixture(scope="session")
def make_llm():
    """make_llm(model, draft=None, **LLM kwargs) -> LLM, with the tests' defaults (see _make_llm)."""
    return _make_llm
