"""Qwen2/2.5 and Qwen3 (models/qwen2.py, models/qwen3.py) against transformers' own classes, fp32, greedy.

Each family is a tiny random model built with transformers' config and model classes and saved as safetensors:
Qwen2 with random q/k/v biases and a tied LM head (as the small Qwen2.5 models), Qwen3 with random per-head q/k
norm weights and an explicit head_dim (32, not hidden / heads = 16). pagedllm's offline LLM must give
transformers' greedy tokens, through a batch of prompts longer than a few KV blocks with n > 1, a prefix cache
hit and chunked prefill. A divergence is allowed only where the reference's top-2 logit gap is below 1e-4.
Their GGUF files, written by llama.cpp's own converter (F32, F16, Q8_0), are checked in test_llamacpp_gguf.py.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.kernels import cpu_kernels
from pagedllm.models import llama_native_step
from pagedllm.models.loader import load_model
from pagedllm.models.model_info import ModelLoadError, model_info_from_hf_config

CPU = torch.device("cpu")


def _save(folder: Path, model, randomize: tuple[str, ...]) -> None:
    """Randomize the parameters whose names end with `randomize` (transformers initializes biases to 0 and norms
    to 1, which would hide a bias or a norm left out), then save as safetensors."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(randomize):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-qwen2")
    tiny_tokenizer.save_pretrained(folder)
    vocab = len(tiny_tokenizer)
    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.08,
                         use_sliding_window=False, sliding_window=4096, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    _save(folder, Qwen2ForCausalLM(config).float(), (".bias",))
    return folder


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-qwen3")
    tiny_tokenizer.save_pretrained(folder)
    vocab = len(tiny_tokenizer)
    config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.08,
                         attention_bias=False, use_sliding_window=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(1)
    _save(folder, Qwen3ForCausalLM(config).float(), ())
    return folder


FAMILIES = ["qwen2_dir", "qwen3_dir"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(folder, the transformers model loaded from it in fp32)."""
    from transformers import AutoModelForCausalLM

    folder = request.getfixturevalue(request.param)
    return folder, AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _prompts(vocab: int) -> list[list[int]]:
    """4 prompts of 40-70 tokens (3-5 KV blocks of 16), sharing a 36-token prefix."""
    rng = random.Random(0)
    shared = [rng.randrange(vocab) for _ in range(36)]
    return [shared + [rng.randrange(vocab) for _ in range(rng.randrange(4, 34))] for _ in range(4)]


def _llm(folder: Path, **kwargs) -> LLM:
    return LLM(str(folder), dtype="float32", max_model_len=256, num_gpu_blocks_override=128, **kwargs)


def test_registered_by_architecture(qwen2_dir, qwen3_dir):
    for folder, cls, head_dim in ((qwen2_dir, "Qwen2ForCausalLM", 16), (qwen3_dir, "Qwen3ForCausalLM", 32)):
        model = load_model(ModelConfig(model=str(folder)), CPU, torch.float32)
        assert type(model).__name__ == cls and model.info.head_dim == head_dim
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (32,)


def test_greedy_matches_transformers_on_every_engine_path(family):
    """transformers' greedy tokens through n=2, prefix-cache hits, chunked prefill, preemption, n-gram speculation
    and fp8 KV (window_family_checks.check_engine_paths)."""
    from window_family_checks import check_engine_paths

    check_engine_paths(*family)


@pytest.mark.skipif(not cpu_kernels.available(torch.float32, CPU), reason="native CPU kernels unavailable")
def test_native_decode_step_only_where_it_fits(qwen2_dir, qwen3_dir, caplog, monkeypatch):
    """--quantization fp8 makes every linear a native-kernel weight: Qwen2's qkv biases run in the native decode
    step (tokens equal to the module path's); Qwen3's per-head q/k norms are not in it, so it is not built, with a
    line at load, and the modules decode."""
    prompts = _prompts(256)[:2]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(folder):
        llm = _llm(folder, quantization="fp8")
        return llm.llm_engine.engine_core.runner.native_step, [
            o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    with caplog.at_level(logging.INFO, logger=llama_native_step.__name__):
        step2, native2 = run(qwen2_dir)
        step3, _ = run(qwen3_dir)
    assert step2 is not None and step3 is None
    assert "Qwen3ForCausalLM: the native decode step has no per-head q/k norms" in caplog.text
    assert "Qwen2ForCausalLM" not in caplog.text
    monkeypatch.setenv(llama_native_step.SWITCH_ENV, "0")
    step, modules2 = run(qwen2_dir)
    assert step is None and modules2 == native2


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic"])
def test_unsupported_rope_scaling_is_refused_at_load_by_name(rope_type):
    config = {"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 4, "hidden_size": 64,
              "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 384,
              "rope_scaling": {"type": rope_type, "factor": 4.0, "original_max_position_embeddings": 512}}
    with pytest.raises(ModelLoadError, match=f"rope scaling '{rope_type}' is not supported"):
        model_info_from_hf_config(config, {}, "qwen")


@pytest.mark.slow  # two worker processes
def test_tensor_parallel_2_matches_transformers(family):
    """q/k/v biases and heads split across the ranks, the q/k norm weights replicated; 2 KV heads, one each."""
    from window_family_checks import check_tensor_parallel

    check_tensor_parallel(*family)


@pytest.mark.slow  # two worker processes
def test_pipeline_parallel_2_gives_one_stages_tokens(family):
    from window_family_checks import check_pipeline_parallel

    folder, hf = family
    check_pipeline_parallel(folder, hf.config.vocab_size)
