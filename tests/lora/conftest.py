"""Fixtures of the LoRA tests: three PEFT adapters of the tiny Llama with random non-zero weights (lora_adapters.py)."""

from __future__ import annotations

import pytest
from lora_adapters import make_adapter

from pagedllm import LLM


@pytest.fixture(scope="session")
def make_llm():
    """make_llm(model, **LLM kwargs) -> LLM in float32, max_model_len 256, a pool of 256 blocks unless told."""
    def make(model, **kwargs) -> LLM:
        kwargs = {"dtype": "float32", "max_model_len": 256, "num_gpu_blocks_override": 256} | kwargs
        return LLM(str(model), **kwargs)
    return make


@pytest.fixture(scope="session")
def tiny_adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    """name -> folder: `sql` (r 8 on every projection), `chat` (r 4 on q, v and down, alpha 8), `rs` (r 16 on q, k,
    v, o with rsLoRA and a rank_pattern giving o_proj rank 4)."""
    root = tmp_path_factory.mktemp("lora-adapters")
    return {
        "sql": str(make_adapter(tiny_llama_dir, root / "sql", seed=1)),
        "chat": str(make_adapter(tiny_llama_dir, root / "chat", seed=2, r=4, alpha=8,
                                 targets=("q_proj", "v_proj", "down_proj"))),
        "rs": str(make_adapter(tiny_llama_dir, root / "rs", seed=3, r=16, alpha=8, use_rslora=True,
                               targets=("q_proj", "k_proj", "v_proj", "o_proj"), rank_pattern={"o_proj": 4})),
    }
