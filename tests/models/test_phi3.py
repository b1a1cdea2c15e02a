"""Phi-3 (models/phi3.py) against transformers' own Phi3ForCausalLM, fp32, greedy.

Two tiny random models built with transformers' classes and saved as safetensors (their q/k/v and gate/up fused in
the checkpoint, as Phi-3's are): `phi3_dir`, Phi-3-mini's shape (full rotary, no rope scaling, untied), and
`phi3_long_dir`, Phi-3-128k's longrope (short and long factors, original context 48) with Phi-4-mini's partial
rotary (factor 0.5: 8 of 16 dimensions) and tied embeddings. The longrope factors are chosen for the context served
(layers/rotary.py): with max_model_len 256 the long ones, which transformers uses for a sequence longer than 48;
with max_model_len 48 the short ones, which it uses for any sequence that fits 48.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.kernels import cpu_kernels
from pagedllm.models import llama_native_step
from pagedllm.models.checkpoint_tensors import partial_rotary_order
from pagedllm.models.loader import load_model
from pagedllm.models.model_info import ModelLoadError, model_info_from_hf_config
from pagedllm.models.phi3 import Phi3ForCausalLM

GAP = 1e-4
NEW_TOKENS = 12
CPU = torch.device("cpu")
ORIGINAL_CONTEXT = 48
SHORT = [1.0, 1.3, 2.0, 3.0]
LONG = [1.5, 2.5, 4.0, 8.0]


def _save(folder: Path, config) -> None:
    from transformers import Phi3ForCausalLM

    torch.manual_seed(0)
    model = Phi3ForCausalLM(config).float()
    with torch.no_grad():  # non-trivial norm weights, so a norm left out shows in the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)


def phi3_config(vocab: int, **kwargs):
    from transformers import Phi3Config

    base = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5,
                initializer_range=0.08, bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    return Phi3Config(**{**base, **kwargs})


def phi3_long_config(vocab: int, **kwargs):
    """Longrope with partial rotary 0.5 and a tied head; `kwargs` (e.g. a wider hidden_size) over phi3_config's."""
    config = phi3_config(vocab, **kwargs)
    half = config.hidden_size // config.num_attention_heads // 4  # rotated frequencies: head_dim * 0.5 / 2
    short, long = (SHORT, LONG) if half == 4 else ([1.0 + i / half for i in range(half)],
                                                   [1.5 + 6 * i / half for i in range(half)])
    return phi3_config(vocab, original_max_position_embeddings=ORIGINAL_CONTEXT, partial_rotary_factor=0.5,
                       tie_word_embeddings=True,
                       rope_scaling={"type": "longrope", "short_factor": short, "long_factor": long}, **kwargs)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tiny-phi3")
    tiny_tokenizer.save_pretrained(folder)
    _save(folder, phi3_config(len(tiny_tokenizer)))
    return folder


@pytest.fixture(scope="module")
def phi3_long_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tiny-phi3-long")
    tiny_tokenizer.save_pretrained(folder)
    _save(folder, phi3_long_config(len(tiny_tokenizer)))
    return folder


def _hf(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _reference(hf, prompt: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens (the whole sequence each step, as its generate does for Phi-3 once a sequence
    crosses the original context), and at each the gap between its top two logits."""
    ids, out, gaps = torch.tensor([prompt]), [], []
    with torch.no_grad():
        for _ in range(num_tokens):
            top = hf(ids).logits[0, -1].topk(2)
            out.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            ids = torch.cat([ids, top.indices[:1].view(1, 1)], dim=1)
    return out, gaps


def _assert_matches(got: list[int], want: tuple[list[int], list[float]]) -> None:
    tokens, gaps = want
    for i, (a, b) in enumerate(zip(got, tokens, strict=True)):
        if a != b:
            assert gaps[i] < GAP, f"token {i}: {a} != transformers' {b} (top-2 gap {gaps[i]:.2e})\n{got}\n{tokens}"
            return  # past a near-tie the continuations may differ


def _prompts(vocab: int, lengths: tuple[int, int] = (52, 70)) -> list[list[int]]:
    """4 prompts of `lengths` tokens (past the original context 48 by default), sharing a 36-token prefix."""
    rng = random.Random(0)
    shared = [rng.randrange(vocab) for _ in range(36)]
    return [shared + [rng.randrange(vocab) for _ in range(rng.randrange(lengths[0] - 36, lengths[1] - 36))]
            for _ in range(4)]


def _llm(folder: Path, max_model_len: int = 256, **kwargs) -> LLM:
    return LLM(str(folder), dtype="float32", max_model_len=max_model_len, num_gpu_blocks_override=128, **kwargs)


def _greedy(n: int = 1, max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)


def test_registered_and_fused_checkpoint_split(phi3_dir, phi3_long_dir):
    """The checkpoint's qkv_proj / gate_up_proj load whole (split and fused back); the rotary facts are read."""
    model = load_model(ModelConfig(model=str(phi3_long_dir)), CPU, torch.float32)
    assert type(model).__name__ == "Phi3ForCausalLM"
    assert model.info.rotary_dim == 8 and model.info.head_dim == 16 and model.info.tie_word_embeddings
    assert model.info.rope_scaling["rope_type"] == "longrope" and model.info.rope_scaling["long_context"]
    layer = model.model.layers[0]
    assert (layer.self_attn.qkv_proj.out_features, layer.mlp.gate_up_proj.out_features) == (128, 256)
    plain = load_model(ModelConfig(model=str(phi3_dir)), CPU, torch.float32)
    assert plain.info.rotary_dim is None and plain.info.rope_scaling is None


def test_partial_rotary_order_pairs_transformers_dimensions():
    order = partial_rotary_order(16, 8)
    assert sorted(order.tolist()) == list(range(16))
    # the table pairs (i, i + 8); transformers rotates (i, i + 4) for i < 4 and passes dimensions 8..15
    assert [(int(order[i]), int(order[i + 8])) for i in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert set(order[4:8].tolist()) | set(order[12:].tolist()) == set(range(8, 16))


@pytest.mark.parametrize("fixture", ["phi3_dir", "phi3_long_dir"])
def test_greedy_matches_transformers_batched_n2_prefix_cache_and_chunked(request, fixture):
    """Prompts past the original context, n=2, then again (prefix cache), then chunked prefill (16-token budget)."""
    folder = request.getfixturevalue(fixture)
    hf = _hf(folder)
    prompts = _prompts(hf.config.vocab_size)
    want = [_reference(hf, p, NEW_TOKENS) for p in prompts]
    llm = _llm(folder)
    for run in range(2):
        outputs = llm.generate(prompts, _greedy(n=2), use_tqdm=False)
        if run == 1:
            assert all(o.num_cached_tokens >= 32 for o in outputs)
        for out, ref in zip(outputs, want, strict=True):
            assert len(out.outputs) == 2
            for completion in out.outputs:
                _assert_matches(list(completion.token_ids), ref)
    chunked = _llm(folder, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=False)
    for out, ref in zip(chunked.generate(prompts, _greedy(), use_tqdm=False), want, strict=True):
        _assert_matches(list(out.outputs[0].token_ids), ref)


def test_longrope_short_factors_within_the_original_context(phi3_long_dir):
    """max_model_len 48 (the original context): the short factors, transformers' for every sequence that fits."""
    hf = _hf(phi3_long_dir)
    prompts = _prompts(hf.config.vocab_size, (38, 40))
    outputs = _llm(phi3_long_dir, max_model_len=ORIGINAL_CONTEXT).generate(prompts, _greedy(max_tokens=8),
                                                                         use_tqdm=False)
    for out, prompt in zip(outputs, prompts, strict=True):
        _assert_matches(list(out.outputs[0].token_ids), _reference(hf, prompt, 8))


@pytest.mark.skipif(not cpu_kernels.available(torch.float32, CPU), reason="native CPU kernels unavailable")
def test_native_decode_step_with_partial_rotary(phi3_long_dir, caplog, monkeypatch):
    """--quantization fp8: the native decode step runs Phi-3 with partial rotary and longrope (the fused rotary
    reads the same table), with the module path's tokens."""
    prompts = _prompts(256)[:2]

    def run():
        llm = _llm(phi3_long_dir, quantization="fp8")
        return llm.llm_engine.engine_core.runner.native_step, [
            o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(max_tokens=8), use_tqdm=False)]

    with caplog.at_level(logging.INFO, logger=llama_native_step.__name__):
        step, native = run()
    assert step is not None and "Phi3ForCausalLM" not in caplog.text
    monkeypatch.setenv(llama_native_step.SWITCH_ENV, "0")
    step, modules = run()
    assert step is None and modules == native


def _config(**kwargs) -> dict:
    return {"architectures": ["Phi3ForCausalLM"], "num_attention_heads": 4, "hidden_size": 64,
            "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 384, "max_position_embeddings": 512,
            **kwargs}


def test_rope_facts_from_config_json():
    """Legacy "su" is longrope; transformers 4's top-level keys and 5's rope_parameters read alike; a window below
    the context is every layer's window (the context is not capped); wrong factor counts are refused."""
    legacy = model_info_from_hf_config(_config(
        original_max_position_embeddings=48, partial_rotary_factor=0.5, sliding_window=300,
        rope_scaling={"type": "su", "short_factor": SHORT, "long_factor": LONG}), {}, "phi3")
    assert legacy.rope_scaling["rope_type"] == "longrope" and legacy.rotary_dim == 8
    assert legacy.rope_scaling["original_max_position_embeddings"] == 48
    assert legacy.rope_scaling["max_position_embeddings"] == 512 and legacy.max_position_embeddings == 512
    assert [Phi3ForCausalLM.attention_options(legacy, i).sliding_window for i in (0, 1)] == [300, 300]
    v5 = model_info_from_hf_config(_config(rope_parameters={
        "rope_type": "longrope", "rope_theta": 500.0, "partial_rotary_factor": 0.5, "short_factor": SHORT,
        "long_factor": LONG, "original_max_position_embeddings": 48}), {}, "phi3")
    assert v5.rope_scaling == {**legacy.rope_scaling} and v5.rope_theta == 500.0 and v5.rotary_dim == 8
    with pytest.raises(ModelLoadError, match="longrope long_factor must have 8 values"):
        model_info_from_hf_config(_config(rope_scaling={"type": "longrope", "short_factor": [1.0] * 8,
                                                        "long_factor": LONG}), {}, "phi3")


@pytest.mark.slow  # two worker processes
def test_tensor_parallel_2_matches_transformers(phi3_long_dir):
    """TP=2: the fused qkv_proj cut by query and KV heads (one KV head each), gate_up_proj by halves."""
    hf = _hf(phi3_long_dir)
    prompts = _prompts(hf.config.vocab_size)[:2]
    llm = _llm(phi3_long_dir, tensor_parallel_size=2)
    try:
        outputs = llm.generate(prompts, _greedy(), use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    for out, prompt in zip(outputs, prompts, strict=True):
        _assert_matches(list(out.outputs[0].token_ids), _reference(hf, prompt, NEW_TOKENS))


def test_a_windowed_phi3_matches_transformers_on_every_engine_path(tmp_path, tiny_tokenizer):
    """Phi-3's sliding_window (every layer, as Mistral's and as transformers' Phi3 apply it) with partial rotary
    0.5: transformers' greedy tokens through n=2, prefix-cache hits, chunked prefill, preemption, n-gram
    speculation and fp8 KV (window_family_checks.py), prompts and generation past the 12-token window."""
    from window_family_checks import WINDOW, check_engine_paths

    tiny_tokenizer.save_pretrained(tmp_path)
    _save(tmp_path, phi3_config(len(tiny_tokenizer), sliding_window=WINDOW, partial_rotary_factor=0.5))
    check_engine_paths(tmp_path, _hf(tmp_path), small_blocks=5, small_budget=16)  # one sliding group: 4 usable


@pytest.mark.slow  # two worker processes
def test_pipeline_parallel_2_gives_one_stages_tokens(phi3_long_dir):
    """Fused checkpoint tensors split per stage, partial rotary and longrope on both stages."""
    from window_family_checks import check_pipeline_parallel

    check_pipeline_parallel(phi3_long_dir, json.loads((phi3_long_dir / "config.json").read_text())["vocab_size"])
