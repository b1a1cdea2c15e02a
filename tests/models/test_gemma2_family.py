"""Gemma 2 (models/gemma2.py) against transformers' Gemma2ForCausalLM (eager), fp32, greedy: GeGLU, sandwich norms,
(1 + w) norms, the scaled embedding, query_pre_attn_scalar (24, not head_dim 32), attention and final logit
soft-capping (small caps, so that they bite on a tiny random model) and a 12-token window on layer 0 (layer 1
global), through every engine path (window_family_checks.py), TP=2, and a GGUF file laid out as llama.cpp's
converter writes it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from paged_runner import PagedRunner
from window_family_checks import (
    WINDOW,
    check_engine_paths,
    check_pipeline_parallel,
    check_tensor_parallel,
    llm,
    prompts,
    save,
)

from pagedllm.config import ModelConfig
from pagedllm.kernels import cpu_kernels
from pagedllm.models import llama_native_step
from pagedllm.models.loader import load_model

CPU = torch.device("cpu")


def _gemma2(folder: Path, tokenizer, scalar: int, seed: int, tied: bool = False) -> Path:
    """Untied by default: with the head tied to a sqrt(hidden)-scaled embedding, a tiny random Gemma repeats one
    token forever, which would hide a decode step's error (the released models tie it; the GGUF test does)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    tokenizer.save_pretrained(folder)
    config = Gemma2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=scalar,
                          max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6, sliding_window=WINDOW,
                          attn_logit_softcapping=2.0, final_logit_softcapping=10.0, initializer_range=0.2,
                          tie_word_embeddings=tied,
                          hidden_activation="gelu_pytorch_tanh", bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    save(folder, Gemma2ForCausalLM(config).float())
    return folder


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return _gemma2(tmp_path_factory.mktemp("tiny-gemma2"), tiny_tokenizer, scalar=24, seed=5)


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
    check_engine_paths(gemma2_dir, gemma2_hf)


@pytest.mark.skipif(not cpu_kernels.available(torch.float32, CPU), reason="native CPU kernels unavailable")
def test_native_decode_step_declines_gemma2(gemma2_dir, caplog):
    with caplog.at_level(logging.INFO, logger=llama_native_step.__name__):
        engine = llm(gemma2_dir, quantization="fp8")
    assert engine.llm_engine.engine_core.runner.native_step is None
    assert "Gemma2ForCausalLM: the native decode step has no sandwich norms" in caplog.text


def _write_gguf(path: Path, folder: Path, qtype=None) -> dict[str, torch.Tensor]:
    """The folder as llama.cpp's convert_hf_to_gguf.py writes Gemma 2 (Gemma2Model): gguf's tensor-name map, norm
    weights + 1, no lm_head, Q/K not permuted, the caps and the window in the metadata, no query_pre_attn_scalar;
    F32, or `qtype` for every matrix. Returns the matrices as stored, dequantized, by Hugging Face name."""
    import gguf
    from safetensors import safe_open

    cfg = json.loads((folder / "config.json").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA2, cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(str(path), "gemma2")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_vocab_size(cfg["vocab_size"])
    stored = {}
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        for name in f.keys():
            if name == "lm_head.weight":
                continue
            t, gname = f.get_tensor(name), names.get_name(name, try_suffixes=(".weight", ".bias"))
            if name.endswith("norm.weight"):
                t = t + 1
            if qtype is None or t.ndim != 2:
                w.add_tensor(gname, t.numpy())
            else:
                codes = gguf.quants.quantize(t.numpy(), qtype)
                w.add_tensor(gname, codes, raw_dtype=qtype)
                stored[name] = torch.from_numpy(gguf.quants.dequantize(codes, qtype).reshape(t.shape).copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def test_gguf_f32_gives_the_folders_logits(tmp_path, tiny_tokenizer):
    """general.architecture "gemma2": the sandwich norms under llama.cpp's names, its stored 1 + w norms, the caps
    and the window from the metadata; a folder whose query_pre_attn_scalar is head_dim (what llama.cpp assumes)."""
    folder = _gemma2(tmp_path / "folder", tiny_tokenizer, scalar=32, seed=6, tied=True)
    _write_gguf(tmp_path / "gemma2.gguf", folder)
    hf_model = load_model(ModelConfig(model=str(folder)), CPU, torch.float32)
    gguf_model = load_model(ModelConfig(model=str(tmp_path / "gemma2.gguf")), CPU, torch.float32)
    assert type(gguf_model) is type(hf_model) and gguf_model.info.tie_word_embeddings
    assert [layer.self_attn.attn.window for layer in gguf_model.model.layers] == [WINDOW, 0]
    ids = prompts(256)[0]
    a = PagedRunner(hf_model).step([("a", ids)])
    b = PagedRunner(gguf_model).step([("a", ids)])
    assert (a - b).abs().max().item() < 1e-5


@pytest.mark.skipif(not cpu_kernels.available(torch.float32, CPU), reason="native CPU kernels unavailable")
def test_q8_0_gguf_matches_transformers_on_its_dequantized_weights(tmp_path, tiny_tokenizer):
    """Every matrix Q8_0 (the tied embedding too), kept quantized and run by the native kernels, the embedding
    scaled after its quantized lookup: transformers' logits on the file's dequantized weights, prefill and decodes."""
    from gguf import GGMLQuantizationType
    from transformers import AutoModelForCausalLM

    folder = _gemma2(tmp_path / "folder", tiny_tokenizer, scalar=32, seed=6, tied=True)
    stored = _write_gguf(tmp_path / "q8.gguf", folder, GGMLQuantizationType.Q8_0)
    model = load_model(ModelConfig(model=str(tmp_path / "q8.gguf")), CPU, torch.float32)
    assert model.model.layers[0].self_attn.qkv_proj.quant_weight is not None
    assert model.model.embed_tokens.quant_weight is not None
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    hf.load_state_dict(stored, strict=False)  # the tied head shares the embedding's (dequantized) tensor
    runner, ids = PagedRunner(model), prompts(256)[1]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(runner.step([("a", ids[:-2])]), want[:-2], atol=1e-4, rtol=1e-4)
    for i in (-2, -1):
        torch.testing.assert_close(runner.step([("a", [ids[i]])])[0], want[i], atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # two worker processes
def test_tensor_parallel_2_matches_transformers(gemma2_dir, gemma2_hf):
    check_tensor_parallel(gemma2_dir, gemma2_hf)


@pytest.mark.slow  # two worker processes
def test_pipeline_parallel_2_gives_one_stages_tokens(gemma2_dir, gemma2_hf):
    """The scaled embedding on the first stage, the final norm, cap and head on the last."""
    check_pipeline_parallel(gemma2_dir, gemma2_hf.config.vocab_size)
