"""Fixtures of the offline LoRA tests (the adapters and their references: tests/conftest.py)."""

from __future__ import annotations

import pytest

from pagedllm import LLM


@pytest.fixture(scope="session")
def make_llm():
    """make_llm(model, **LLM kwargs) -> LLM in float32, max_model_len 256, a pool of 256 blocks unless told."""
    def make(model, **kwargs) -> LLM:
        kwargs = {"dtype": "float32", "max_model_len": 256, "num_gpu_blocks_override": 256} | kwargs
        return LLM(str(model), **kwargs)
    return make
