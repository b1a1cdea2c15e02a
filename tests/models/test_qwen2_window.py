"""Qwen2's sliding window as transformers' Qwen2Config defines it (models/qwen2.py): only with use_sliding_window,
on the layers at and past max_window_layers (transformers' layer_types); the window no longer caps the context."""

from __future__ import annotations

from pathlib import Path

import torch
from paged_runner import PagedRunner
from window_family_checks import WINDOW, prompts, save

from pagedllm.config import ModelConfig
from pagedllm.models.loader import load_model

CPU = torch.device("cpu")


def _qwen2(folder: Path, tokenizer, use_sliding_window: bool) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer.save_pretrained(folder)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_theta=10000.0, rms_norm_eps=1e-6, initializer_range=0.08, tie_word_embeddings=False,
                         use_sliding_window=use_sliding_window, sliding_window=WINDOW, max_window_layers=1,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(7)
    save(folder, Qwen2ForCausalLM(config).float())
    return folder


def test_window_on_the_layers_past_max_window_layers_matches_transformers(tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    folder = _qwen2(tmp_path / "windowed", tiny_tokenizer, use_sliding_window=True)
    model = load_model(ModelConfig(model=str(folder)), CPU, torch.float32)
    assert [layer.self_attn.attn.window for layer in model.model.layers] == [0, WINDOW]
    assert model.info.max_position_embeddings == 512
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids, runner = prompts(256)[2], PagedRunner(model)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(runner.step([("a", ids[:-2])]), want[:-2], atol=2e-5, rtol=1e-4)
    for i in (-2, -1):
        torch.testing.assert_close(runner.step([("a", [ids[i]])])[0], want[i], atol=2e-5, rtol=1e-4)
    off = load_model(ModelConfig(model=str(_qwen2(tmp_path / "off", tiny_tokenizer, False))), CPU, torch.float32)
    assert [layer.self_attn.attn.window for layer in off.model.layers] == [0, 0]
