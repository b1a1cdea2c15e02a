"""Gemma 3 (models/gemma3.py) against transformers' Gemma3ForCausalLM (eager), fp32, greedy: Gemma 2's decoder plus
(1 + w) q/k norms, no soft-caps, 4 layers of which layer 2 is global (layer_types: a global layer between sliding
ones, in 4 layers rather than the default pattern's 6, to keep the engine checks short; the pattern itself is checked
on config keys below, and by the converter-written file and the 270M file), a 32-token window on the others, the
global layers' rotary (base 1e6, linear scaling 4) and the sliding layers' own (base 1e4), query_pre_attn_scalar 24
(not head_dim 32); prompts of 70-140 tokens (2-4 windows), through every engine path (window_family_checks.py),
TP=2 and PP=2. The real Gemma 3 270M file: tests/models/test_gemma3_270m.py; a
converter-written file: tests/models/test_llamacpp_gguf.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from paged_runner import PagedRunner
from window_family_checks import (
    GREEDY,
    check_engine_paths,
    check_native_step_declines,
    check_pipeline_parallel,
    check_tensor_parallel,
    llm,
    save,
    tokens,
)

from pagedllm.config import ModelConfig
from pagedllm.core.kv_cache_coordinator import HybridKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.kernels import cpu_kernels
from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.llama import AttentionOptions
from pagedllm.models.loader import load_model
from pagedllm.models.model_info import model_info_from_hf_config

CPU = torch.device("cpu")
WINDOW = 32
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
GLOBAL_ROPE = {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}
LOCAL_BASE = 1e4


def long_prompts(vocab: int) -> list[list[int]]:
    """4 prompts of 70-140 tokens sharing a 64-token prefix (2 windows, 4 KV blocks); the last repeats a motif
    (n-gram drafts get proposed and accepted)."""
    rng = random.Random(1)
    shared = [rng.randrange(vocab) for _ in range(64)]
    out = [shared + [rng.randrange(vocab) for _ in range(n)] for n in (6, 41, 76)]
    motif = [rng.randrange(vocab) for _ in range(6)]
    return out + [shared + motif * 9]


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """Untied (a tiny random Gemma tied to its sqrt(hidden)-scaled embedding repeats one token forever)."""
    from transformers import Gemma3ForCausalLM as HFGemma3
    from transformers import Gemma3TextConfig

    folder = tmp_path_factory.mktemp("tiny-gemma3")
    tiny_tokenizer.save_pretrained(folder)
    config = Gemma3TextConfig(
        vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
        max_position_embeddings=512, rms_norm_eps=1e-6, sliding_window=WINDOW, layer_types=LAYER_TYPES,
        initializer_range=0.2,
        rope_parameters={"full_attention": dict(GLOBAL_ROPE),
                         "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_BASE}},
        tie_word_embeddings=False, hidden_activation="gelu_pytorch_tanh", bos_token_id=1, eos_token_id=2,
        pad_token_id=0)
    torch.manual_seed(7)
    save(folder, HFGemma3(config).float())
    return folder


@pytest.fixture(scope="module")
def gemma3_hf(gemma3_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gemma3_dir), dtype=torch.float32, attn_implementation="eager")
    assert type(model).__name__ == "Gemma3ForCausalLM"
    return model.eval()


def test_layers_windows_rotaries_and_scale(gemma3_dir):
    model = load_model(ModelConfig(model=str(gemma3_dir)), CPU, torch.float32)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    attns = [layer.self_attn.attn for layer in model.model.layers]
    assert [a.window for a in attns] == [WINDOW, WINDOW, 0, WINDOW]
    assert all(a.softcap == 0.0 and a.scale == 24**-0.5 for a in attns)  # 0.0: no soft-capping
    assert model.final_logit_softcap is None
    assert (model.info.rope_theta, model.info.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 4.0})
    (local,) = model.model.layer_rotary  # one more table: the sliding layers'
    assert (local.theta, local.scaling) == (LOCAL_BASE, None)
    assert model.model.layer_rotary_index == [1, 1, 0, 1]


def test_transformers_4_config_keys():
    """A config.json as transformers 4 wrote Gemma 3's (google/gemma-3-4b-it's text config, 8 of its layers):
    rope_theta, rope_scaling, rope_local_base_freq, no layer_types; sliding_window_pattern where set (4 here), else
    6."""
    config = {"architectures": ["Gemma3ForCausalLM"], "num_attention_heads": 8, "num_key_value_heads": 4,
              "hidden_size": 2560, "head_dim": 256, "num_hidden_layers": 8, "intermediate_size": 10240,
              "vocab_size": 262208, "query_pre_attn_scalar": 256, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
              "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
              "final_logit_softcapping": None, "attn_logit_softcapping": None}
    sliding = AttentionOptions(sliding_window=1024, scale=256**-0.5, rope=(1e4, None))
    full = AttentionOptions(scale=256**-0.5)
    for pattern, want in ((4, [sliding] * 3 + [full] + [sliding] * 3 + [full]), (None, [sliding] * 5 + [full] +
                                                                                 [sliding] * 2)):
        info = model_info_from_hf_config({**config, "sliding_window_pattern": pattern}, {}, "gemma-3-4b")
        assert (info.rope_theta, info.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
        assert [Gemma3ForCausalLM.attention_options(info, i) for i in range(8)] == want


def test_logits_match_transformers_prefill_and_decodes(gemma3_dir, gemma3_hf):
    """A 137-token prefill (4 windows) then decodes past it, on the module path."""
    model = load_model(ModelConfig(model=str(gemma3_dir)), CPU, torch.float32)
    ids = long_prompts(256)[2]
    runner = PagedRunner(model)
    with torch.no_grad():
        want = gemma3_hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(runner.step([("a", ids[:-3])]), want[:-3], atol=2e-5, rtol=1e-4)
    for i in (-3, -2, -1):
        torch.testing.assert_close(runner.step([("a", [ids[i]])])[0], want[i], atol=2e-5, rtol=1e-4)


def test_greedy_matches_transformers_on_every_engine_path(gemma3_dir, gemma3_hf):
    check_engine_paths(gemma3_dir, gemma3_hf, long_prompts(gemma3_hf.config.vocab_size), small_blocks=25,
                       small_len=192, small_budget=16)


def test_disable_hybrid_kv_cache_manager_keeps_every_block_and_the_tokens(gemma3_dir, gemma3_hf):
    """vLLM's --disable-hybrid-kv-cache-manager: one block table of every layer (a block of 4 layers, not 1), the
    sliding layers' blocks never freed, and the default's greedy tokens."""
    ps = long_prompts(gemma3_hf.config.vocab_size)
    default, plain = llm(gemma3_dir), llm(gemma3_dir, disable_hybrid_kv_cache_manager=True)
    assert type(default.llm_engine.engine_core.scheduler.kv_cache_manager) is HybridKVCacheManager
    assert type(plain.llm_engine.engine_core.scheduler.kv_cache_manager) is KVCacheManager
    assert tokens(plain.generate(ps, GREEDY, use_tqdm=False)) == tokens(default.generate(ps, GREEDY, use_tqdm=False))


@pytest.mark.skipif(not cpu_kernels.available(torch.float32, CPU), reason="native CPU kernels unavailable")
def test_native_decode_step_declines_gemma3(gemma3_dir, caplog):
    check_native_step_declines(gemma3_dir, caplog, "4 KV cache groups")


@pytest.mark.slow  # two worker processes
def test_tensor_parallel_2_matches_transformers(gemma3_dir, gemma3_hf):
    check_tensor_parallel(gemma3_dir, gemma3_hf, long_prompts(gemma3_hf.config.vocab_size))


@pytest.mark.slow  # two worker processes
def test_pipeline_parallel_2_gives_one_stages_tokens(gemma3_dir, gemma3_hf):
    """Stage 0 layers 0-1 (sliding: its one extra table), stage 1 layers 2-3 (both tables), the scaled embedding
    on the first stage, the final norm and head on the last."""
    check_pipeline_parallel(gemma3_dir, gemma3_hf.config.vocab_size, long_prompts(gemma3_hf.config.vocab_size))
