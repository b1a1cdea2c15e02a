"""Mistral (models/mistral.py) against transformers' MistralForCausalLM, fp32, greedy: a 12-token sliding window on
every layer, prompts of 40-70 tokens and generation past the window, through every engine path
(window_family_checks.py); `sliding_window: null` is full attention; TP=2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from window_family_checks import (
    GREEDY,
    NGRAM,
    WINDOW,
    check_engine_paths,
    check_pipeline_parallel,
    check_tensor_parallel,
    llm,
    prompts,
    save,
    tokens,
)

from pagedllm.config import ModelConfig
from pagedllm.kernels import cpu_kernels
from pagedllm.models import llama_native_step
from pagedllm.models.loader import load_model

CPU = torch.device("cpu")


def _mistral(folder: Path, tokenizer, window: int | None, seed: int) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    tokenizer.save_pretrained(folder)
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           rope_theta=10000.0, rms_norm_eps=1e-6, sliding_window=window, initializer_range=0.08,
                           tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    save(folder, MistralForCausalLM(config).float())
    return folder


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return _mistral(tmp_path_factory.mktemp("tiny-mistral"), tiny_tokenizer, WINDOW, seed=3)


@pytest.fixture(scope="module")
def mistral_hf(mistral_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(mistral_dir), dtype=torch.float32).eval()


def test_window_from_config_and_null_is_full_attention(mistral_dir, tmp_path, tiny_tokenizer):
    model = load_model(ModelConfig(model=str(mistral_dir)), CPU, torch.float32)
    assert type(model).__name__ == "MistralForCausalLM"
    assert [layer.self_attn.attn.window for layer in model.model.layers] == [WINDOW, WINDOW]
    assert model.info.max_position_embeddings == 512  # the window no longer caps the context
    full = load_model(ModelConfig(model=str(_mistral(tmp_path, tiny_tokenizer, None, seed=4))), CPU, torch.float32)
    assert [layer.self_attn.attn.window for layer in full.model.layers] == [0, 0]


def test_greedy_matches_transformers_on_every_engine_path(mistral_dir, mistral_hf):
    check_engine_paths(mistral_dir, mistral_hf, small_blocks=5, small_budget=16)  # one sliding group: 4 usable blocks


@pytest.mark.skipif(not cpu_kernels.available(torch.float32, CPU), reason="native CPU kernels unavailable")
def test_native_decode_step_runs_the_window(mistral_dir, mistral_hf, monkeypatch):
    """--quantization fp8 makes every linear a native-kernel weight: the native decode step runs the windowed
    layers (decodes and n-gram verify rows), with the module path's tokens."""
    ps = prompts(mistral_hf.config.vocab_size)

    def run(**kwargs):
        engine = llm(mistral_dir, quantization="fp8", **kwargs)
        return engine.llm_engine.engine_core.runner.native_step, tokens(engine.generate(ps, GREEDY, use_tqdm=False))

    step, native = run()
    assert step is not None
    assert [c.window for c in step._c_layers] == [WINDOW, WINDOW]
    assert run(speculative_config=NGRAM)[1] == native
    monkeypatch.setenv(llama_native_step.SWITCH_ENV, "0")
    step, modules = run()
    assert step is None and modules == native


@pytest.mark.slow  # two worker processes
def test_tensor_parallel_2_matches_transformers(mistral_dir, mistral_hf):
    check_tensor_parallel(mistral_dir, mistral_hf)


@pytest.mark.slow  # two worker processes
def test_pipeline_parallel_2_gives_one_stages_tokens(mistral_dir, mistral_hf):
    check_pipeline_parallel(mistral_dir, mistral_hf.config.vocab_size)
