"""--calculate-kv-scales (on by default for fp8 caches): per-layer K/V scales and K's error-feedback rounding,
from a fixed calibration text at load."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.worker.kv_scales import attention_layers

SHRINK = 2.0**-10  # K and V of the shrunk model: e4m3 subnormals (below 2^-6) and zeros with scale 1


@pytest.fixture(scope="module")
def small_kv_llama_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny model with K and V 1024x smaller and q_proj / o_proj 1024x larger: in fp32 the same function
    (powers of two), but its K/V values sit below e4m3's normal range."""
    folder = tmp_path_factory.mktemp("small-kv-llama")
    for f in tiny_llama_dir.iterdir():
        shutil.copy(f, folder / f.name)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name in tensors:
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensors[name] = tensors[name] * SHRINK
        elif name.endswith(("q_proj.weight", "o_proj.weight")):
            tensors[name] = tensors[name] / SHRINK
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def _llm(model_dir, **kwargs):
    return LLM(str(model_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=64, **kwargs)


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, size=int(n)).tolist() for n in (40, 70, 100)]


def _prompt_logprobs(llm, prompts) -> np.ndarray:
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return np.concatenate([[entry[tok].logprob for entry, tok in zip(o.prompt_logprobs[1:], p[1:], strict=True)]
                           for o, p in zip(outs, prompts, strict=True)])


def test_scales_keep_fp8_drift_small_where_scale_one_loses_the_values(small_kv_llama_dir):
    exact = _llm(small_kv_llama_dir)
    prompts = _prompts(exact.llm_engine.engine_core.vocab_size)
    reference = _prompt_logprobs(exact, prompts)
    unscaled_llm = _llm(small_kv_llama_dir, kv_cache_dtype="fp8", calculate_kv_scales=False)
    unscaled = np.abs(_prompt_logprobs(unscaled_llm, prompts) - reference).mean()
    scaled_llm = _llm(small_kv_llama_dir, kv_cache_dtype="fp8")  # the default for fp8
    scaled = np.abs(_prompt_logprobs(scaled_llm, prompts) - reference).mean()
    assert scaled < 0.04 and unscaled > 10 * scaled, (scaled, unscaled)  # measured 0.021, 0.49
    layers = attention_layers(scaled_llm.llm_engine.engine_core.runner.model)
    for layer in layers:  # powers of two around the shrunk values' range
        for scale in (layer.k_scale, layer.v_scale):
            assert scale == 2.0 ** round(np.log2(scale)) and 2.0**-20 < scale < 2.0**-8
        assert layer.k_comp is not None and layer.k_comp.shape == (layer.num_kv_heads, layer.head_dim, layer.head_dim)
    assert scaled_llm.llm_engine.engine_core.cache_config_info()["calculate_kv_scales"] == "True"
    for layer in attention_layers(unscaled_llm.llm_engine.engine_core.runner.model):
        assert (layer.k_scale, layer.v_scale, layer.k_comp) == (1.0, 1.0, None)


def test_scales_are_fixed_at_load_and_the_torch_path_agrees(small_kv_llama_dir, monkeypatch):
    """The same scales in every engine (calibrated from the built-in text, not from requests); the torch paths
    (no native kernels) store and read the same values as the native ones."""
    native = _llm(small_kv_llama_dir, kv_cache_dtype="fp8", calculate_kv_scales=True)
    prompts = _prompts(native.llm_engine.engine_core.vocab_size)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    native_tokens = [o.outputs[0].token_ids for o in native.generate(prompts, greedy, use_tqdm=False)]
    native_logprobs = _prompt_logprobs(native, prompts)
    from pagedllm.kernels import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "kv_cache_native", lambda *args: False)
    fallback = _llm(small_kv_llama_dir, kv_cache_dtype="fp8", calculate_kv_scales=True)
    scales = [[(a.k_scale, a.v_scale) for a in attention_layers(llm.llm_engine.engine_core.runner.model)]
              for llm in (native, fallback)]
    assert scales[0] == scales[1]
    assert [o.outputs[0].token_ids for o in fallback.generate(prompts, greedy, use_tqdm=False)] == native_tokens
    np.testing.assert_allclose(_prompt_logprobs(fallback, prompts), native_logprobs, atol=1e-4)


def test_calculate_kv_scales_needs_an_fp8_cache(tiny_llama_dir):
    with pytest.raises(ValueError, match="calculate-kv-scales needs an fp8"):
        _llm(tiny_llama_dir, calculate_kv_scales=True)
    auto = _llm(tiny_llama_dir)  # not asked, not fp8: nothing calculated
    assert auto.llm_engine.engine_core.cache_config_info()["calculate_kv_scales"] == "False"
    assert all(layer.k_comp is None for layer in attention_layers(auto.llm_engine.engine_core.runner.model))


def test_flag_is_tri_state():
    import argparse

    from pagedllm.config import CacheConfig, add_dataclass_flags

    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, CacheConfig, "")
    assert parser.parse_args([]).calculate_kv_scales is None
    assert parser.parse_args(["--calculate-kv-scales"]).calculate_kv_scales is True
    assert parser.parse_args(["--no-calculate-kv-scales"]).calculate_kv_scales is False
