"""Gemma 2 (models/gemma2.py) against transformers' Gemma2ForCausalLM (eager), fp32, greedy: GeGLU, sandwich norms,
(1 + w) norms, the scaled embedding, query_pre_attn_scalar (24, not head_dim 32), attention and final logit
soft-capping (small caps, so that they bite on a tiny random model) and a 12-token window on layer 0 (layer 1
global), through every engine path (window_family_checks.py), TP=2 and PP=2. Gemma 2 GGUF files written by
llama.cpp's own converter: tests/models/test_llamacpp_gguf.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from paged_runner import PagedRunner
from window_family_checks import (
    WINDOW,
    check_engine_paths,
    check_native_step_declines,
    check_pipeline_parallel,
    check_tensor_parallel,
    prompts,
    save,
)

from pagedllm.config import ModelConfig
from pagedllm.kernels import cpu_kernels
from pagedllm.models.loader import load_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """Untied: with the head tied to a sqrt(hidden)-scaled embedding, a tiny random Gemma repeats one token forever,
    which would hide a decode step's error (the released models tie it; the converter test's Gemma 2 does)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-gemma2")
    tiny_tokenizer.save_pretrained(folder)
    config = Gemma2Config(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
                          max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6, sliding_window=WINDOW,
                          attn_logit_softcapping=2.0, final_logit_softcapping=10.0, initializer_range=0.2,
                          tie_word_embeddings=False, hidden_activation="gelu_pytorch_tanh", bos_token_id=1,
                          eos_token_id=2, pad_token_id=0)
    torch.manual_seed(5)
    save(folder, Gemma2ForCausalLM(config).float())
    return folder


@pytest.fixture(scope="module")
def gemma2_hf(gemma2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gemma2_dir), dtype=torch.float32,
                                                attn_implementation="eager").eval()


def test_layers_alternate_window_and_global_with_caps_and_scale(gemma2_dir):
    model = load_model(ModelConfig(model=str(gemma2_dir)), CPU, torch.float32)
    assert type(model).__name__ == "Gemma2ForCausalLM"
    attns = [layer.self_attn.attn for layer in model.model.layers]
    assert [a.window for a in attns] == [WINDOW, 0]  # transformers' layer_types: even layers slide
    assert all(a.softcap == 2.0 and a.scale == 24**-0.5 for a in attns)
    assert model.final_logit_softcap == 10.0


def test_logits_match_transformers_prefill_and_decodes(gemma2_dir, gemma2_hf):
    """The logits themselves (the final soft-cap is monotonic: greedy tokens cannot see it): a 60-token prefill
    then decodes past it, on the module path's native kernels."""
    model = load_model(ModelConfig(model=str(gemma2_dir)), CPU, torch.float32)
    ids = prompts(256)[0]
    runner = PagedRunner(model)
    with torch.no_grad():
        want = gemma2_hf(torch.tensor([ids])).logits[0]
    assert want.abs().max() < 10.0  # capped
    torch.testing.assert_close(runner.step([("a", ids[:-3])]), want[:-3], atol=2e-5, rtol=1e-4)
    for i in (-3, -2, -1):
        torch.testing.assert_close(runner.step([("a", [ids[i]])])[0], want[i], atol=2e-5, rtol=1e-4)


def test_greedy_matches_transformers_on_every_engine_path(gemma2_dir, gemma2_hf):
    check_engine_paths(gemma2_dir, gemma2_hf, small_blocks=12, small_budget=16)  # the pool's minimum: 1-layer blocks


@pytest.mark.skipif(not cpu_kernels.available(torch.float32, CPU), reason="native CPU kernels unavailable")
def test_native_decode_step_declines_gemma2(gemma2_dir, caplog):
    check_native_step_declines(gemma2_dir, caplog, "2 KV cache groups")


@pytest.mark.slow  # two worker processes
def test_tensor_parallel_2_matches_transformers(gemma2_dir, gemma2_hf):
    check_tensor_parallel(gemma2_dir, gemma2_hf)


@pytest.mark.slow  # two worker processes
def test_pipeline_parallel_2_gives_one_stages_tokens(gemma2_dir, gemma2_hf):
    """The scaled embedding on the first stage, the final norm, cap and head on the last."""
    check_pipeline_parallel(gemma2_dir, gemma2_hf.config.vocab_size)
