"""EngineCore in process with the tiny model: max_model_len is resolved once and read by every part, the
configuration is not mutated, and a pool that cannot hold one longest request is refused before the KV cache is
allocated."""

from __future__ import annotations

import copy

import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.core import EngineCore


def _config(model, **kwargs) -> EngineConfig:
    return EngineConfig.from_kwargs(model=str(model), dtype="float32", kv_cache_memory=16 << 20, **kwargs)


@pytest.mark.parametrize("max_model_len, expected", [(None, 512), (100, 100)])
def test_max_model_len_is_resolved_once(tiny_llama_dir, max_model_len, expected):
    config = _config(tiny_llama_dir, max_model_len=max_model_len)
    before = copy.deepcopy(config)
    core = EngineCore(config)
    try:
        assert core.max_model_len == expected  # the model's context length is 512
        assert core.scheduler.max_model_len == expected
        assert core.scheduler.kv_cache_manager.max_model_len == expected
        assert core.runner.input_batch.max_model_len == expected
        assert core.model_limits().max_model_len == expected
        assert config == before  # before: the engine wrote it into config.scheduler_config
    finally:
        core.shutdown()


def test_a_pool_too_small_for_one_request_is_refused(tiny_llama_dir, monkeypatch):
    allocated = []
    from pagedllm.worker.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "initialize_kv_cache", lambda self, n: allocated.append(n))
    with pytest.raises(ValueError, match=r"3 KV blocks of 16 tokens cannot hold one request of max_model_len=512"):
        EngineCore(_config(tiny_llama_dir, num_gpu_blocks_override=3))
    assert allocated == []  # refused before the pool is allocated
    EngineCore(_config(tiny_llama_dir, num_gpu_blocks_override=32)).shutdown()  # 32 x 16 = 512: fits
    assert allocated == [32]
