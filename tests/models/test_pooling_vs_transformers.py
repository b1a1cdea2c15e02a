"""Embeddings (runner pooling) against transformers' hidden states: a tiny random Llama and Qwen3 in fp32.

The reference is the model's last hidden state after the final norm (`output_hidden_states[-1]` of the ForCausalLM,
which transformers takes after `model.norm`), pooled as vLLM pools a decoder model (LAST token, MEAN over the
prompt, CLS: the first token) and L2-normalised. pagedllm's vectors must be within 1e-5 cosine distance, for a
batch of prompts of mixed lengths, with chunked prefill (a step of 16 tokens: MEAN and CLS pooled across chunks),
and the same bits batched or one at a time. The pooling type comes from --pooler-config or, for a
sentence-transformers folder, from its modules.json and 1_Pooling/config.json.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, PoolingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Hello", "Paged attention stores the KV cache in "
           "fixed-size blocks, and a language model predicts the next token from the previous ones, again and again.",
           "Numbers like 12345 and 2024 appear in text."]


@functools.cache
def _hidden_states(model_dir: Path, ids: tuple[int, ...]) -> torch.Tensor:
    """transformers' last hidden state (after the final norm) of one prompt: [T, H]."""
    with torch.no_grad():
        return _model(model_dir)(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


@functools.cache
def _model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _reference(model_dir: Path, prompt_ids: list[list[int]], pooling: str) -> list[torch.Tensor]:
    vectors = []
    for ids in prompt_ids:
        hidden = _hidden_states(model_dir, tuple(ids))
        pooled = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling]
        vectors.append(torch.nn.functional.normalize(pooled, dim=-1))
    return vectors


def _check(llm: LLM, model_dir: Path, pooling: str) -> None:
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer.encode(p) for p in PROMPTS]
    assert max(len(i) for i in ids) > 32  # longer than two steps of 16 tokens: chunked
    outputs = llm.embed(PROMPTS, use_tqdm=False)
    reference = _reference(model_dir, ids, pooling)
    for output, ref, prompt_ids in zip(outputs, reference, ids, strict=True):
        vector = torch.tensor(output.outputs.embedding)
        assert output.prompt_token_ids == prompt_ids and output.finished
        assert vector.shape == ref.shape
        assert 1 - torch.nn.functional.cosine_similarity(vector, ref, dim=0).item() <= 1e-5
        assert abs(vector.norm().item() - 1) < 1e-5
    # one at a time: the same bits as in the mixed batch
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert llm.embed(prompt, use_tqdm=False)[0].outputs.embedding == output.outputs.embedding
    scheduler = llm.llm_engine.engine_core.scheduler
    assert scheduler.num_free_blocks == scheduler.num_total_blocks


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_llama_pooling_matches_transformers(tiny_llama_dir, pooling):
    llm = LLM(str(tiny_llama_dir), runner="pooling", pooler_config={"pooling_type": pooling}, dtype="float32",
              max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=16)
    _check(llm, tiny_llama_dir, pooling)
    if pooling == "LAST":  # prefix caching reads hits for LAST (the last token is always recomputed)
        again = llm.embed(PROMPTS[2], use_tqdm=False)[0]
        assert again.num_cached_tokens > 0
        assert again.outputs.embedding == llm.embed(PROMPTS, use_tqdm=False)[2].outputs.embedding
    else:  # MEAN and CLS need every row: no prefix-cache hit
        assert llm.embed(PROMPTS[2], use_tqdm=False)[0].num_cached_tokens == 0
    if pooling == "MEAN":  # 5 blocks, chunks of 8 tokens: the prompts preempt each other, same vectors
        expected = [o.outputs.embedding for o in llm.embed(PROMPTS * 2, use_tqdm=False)]
        small = LLM(str(tiny_llama_dir), runner="pooling", pooler_config={"pooling_type": pooling}, dtype="float32",
                    max_model_len=64, num_gpu_blocks_override=5, max_num_batched_tokens=32,
                    long_prefill_token_threshold=8)
        assert [o.outputs.embedding for o in small.embed(PROMPTS * 2, use_tqdm=False)] == expected
        scheduler = small.llm_engine.engine_core.scheduler
        assert scheduler.num_preemptions > 0 and scheduler.num_free_blocks == scheduler.num_total_blocks


def test_sentence_transformers_folder_decides(tiny_llama_dir, tmp_path):
    """modules.json + 1_Pooling/config.json (mean tokens), no Normalize module: runner auto resolves to pooling,
    MEAN pooling, not normalised (vLLM reads the folder the same way)."""
    folder = tmp_path / "st"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}))
    llm = LLM(str(folder), dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    assert llm.runner_type == "pooling"
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    vector = torch.tensor(llm.embed(PROMPTS[0], use_tqdm=False)[0].outputs.embedding)
    ref = _reference(folder, [ids], "MEAN")[0]
    assert 1 - torch.nn.functional.cosine_similarity(vector, ref, dim=0).item() <= 1e-5
    assert abs(vector.norm().item() - 1) > 1e-3  # no Normalize module: not normalised
    # a request's use_activation normalises it
    normed = llm.embed(PROMPTS[0], use_tqdm=False, pooling_params=PoolingParams(use_activation=True))[0]
    assert torch.allclose(torch.tensor(normed.outputs.embedding), torch.nn.functional.normalize(vector, dim=0),
                          atol=1e-6)


def test_qwen3_mean_pooling(tmp_path, tiny_tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tiny_tokenizer.save_pretrained(tmp_path)
    config = Qwen3Config(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    llm = LLM(str(tmp_path), convert="embed", pooler_config='{"pooling_type": "MEAN"}', dtype="float32",
              max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=16)
    assert llm.runner_type == "pooling"
    _check(llm, tmp_path, "MEAN")


def test_runner_refusals_and_truncation(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), runner="pooling", dtype="float32", max_model_len=128,
              num_gpu_blocks_override=32)
    with pytest.raises(ValueError, match="only supported for generative models"):
        llm.generate("Hello")
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        llm.embed("Hello", pooling_params=PoolingParams(dimensions=8))
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    assert llm.embed(PROMPTS[0], truncate_prompt_tokens=3, use_tqdm=False)[0].outputs.embedding == \
        llm.embed(ids[:3], use_tqdm=False)[0].outputs.embedding
    generator = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_gpu_blocks_override=32)
    with pytest.raises(ValueError, match="--convert embed"):
        generator.embed("Hello")
