"""The draft-model proposer end to end: a draft equal to the target has every greedy draft accepted; a different
draft leaves greedy output bit-identical to plain decoding (batched, preempted, prefix-cached, with an abort in
the middle); seeded sampling repeats; a draft with another tokenizer is a startup error naming both models."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams

GREEDY_16 = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _stats(llm: LLM):
    return llm.llm_engine.engine_core.scheduler.spec_decoding_totals


def _assert_all_free(llm: LLM) -> None:
    scheduler = llm.llm_engine.engine_core.scheduler
    assert scheduler.num_free_blocks == scheduler.num_total_blocks


@pytest.fixture(scope="module")
def shallow_draft(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny target without its last layer (same tokenizer, embeddings and head): it agrees with the target
    on some tokens, so both acceptance and rejection happen."""
    import torch
    from transformers import LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama-draft")
    for f in tiny_llama_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, folder / f.name)
    target = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    target.model.layers = target.model.layers[:2]
    target.config.num_hidden_layers = 2
    target.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def reference(make_llm, tiny_llama_dir):
    rng = random.Random(7)
    prompts = []
    for i in range(6):
        motif = [rng.randrange(384) for _ in range(rng.randrange(3, 8))]
        prompts.append(motif * 4 if i % 2 else [rng.randrange(384) for _ in range(rng.randrange(5, 40))])
    plain = make_llm(tiny_llama_dir)
    return prompts, _tokens(plain.generate(prompts, GREEDY_16, use_tqdm=False))


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_model_len": 64},  # a scratch cache of 4 blocks: drafted in small groups
    {"max_num_batched_tokens": 16},  # contexts over 16 tokens: the draft prefills them in chunks
], ids=["default", "small-scratch", "chunked"])
def test_draft_equal_to_target_accepts_every_greedy_draft(make_llm, tiny_llama_dir, reference, engine_args):
    prompts, expected = reference
    llm = make_llm(tiny_llama_dir, draft=tiny_llama_dir, **engine_args)
    assert _tokens(llm.generate(prompts, GREEDY_16, use_tqdm=False)) == expected
    stats = _stats(llm)
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    _assert_all_free(llm)


@pytest.mark.parametrize("engine_args", [{}, {"num_gpu_blocks_override": 12, "max_model_len": 96}],
                         ids=["default", "preempted"])
def test_different_draft_keeps_greedy_output_bit_identical(make_llm, tiny_llama_dir, shallow_draft, reference,
                                                           engine_args):
    prompts, expected = reference
    llm = make_llm(tiny_llama_dir, draft=shallow_draft, **engine_args)
    assert _tokens(llm.generate(prompts, GREEDY_16, use_tqdm=False)) == expected
    stats = _stats(llm)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if engine_args:
        assert llm.llm_engine.num_preemptions > 0
    else:  # again: the longest prompt now hits the prefix cache
        i = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        (again,) = llm.generate([prompts[i]], GREEDY_16, use_tqdm=False)
        assert again.outputs[0].token_ids == expected[i] and again.num_cached_tokens >= 16
    _assert_all_free(llm)


def test_fp8_kv_cache_with_a_draft(make_llm, tiny_llama_dir, shallow_draft, reference):
    """--kv-cache-dtype fp8: the target's pool is fp8, the draft's scratch cache stays float32; greedy output equals
    the fp8 run without speculation."""
    prompts, _ = reference
    plain = _tokens(make_llm(tiny_llama_dir, kv_cache_dtype="fp8").generate(prompts, GREEDY_16, use_tqdm=False))
    llm = make_llm(tiny_llama_dir, draft=shallow_draft, kv_cache_dtype="fp8")
    assert _tokens(llm.generate(prompts, GREEDY_16, use_tqdm=False)) == plain
    assert llm.llm_engine.engine_core.executor.driver_worker.model_runner.proposer.kv_caches[0].dtype == \
        torch.float32
    assert _stats(llm).num_accepted_tokens > 0


def test_abort_and_seeded_sampling_with_a_draft(make_llm, tiny_llama_dir, shallow_draft, reference):
    prompts, expected = reference
    llm = make_llm(tiny_llama_dir, draft=shallow_draft)
    engine = llm.llm_engine
    engine.add_request("gone", prompts[0], GREEDY_16)
    engine.add_request("kept", prompts[1], GREEDY_16, output_kind="final_only")
    engine.step()
    engine.step()
    engine.abort_request(["gone"])
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.outputs[0].token_ids) for o in finished] == [("kept", expected[1])]
    _assert_all_free(llm)

    seeded = SamplingParams(n=2, temperature=1.0, top_k=20, seed=11, max_tokens=12, ignore_eos=True)
    (first,) = llm.generate([prompts[1]], seeded, use_tqdm=False)
    (again,) = llm.generate([prompts[1]], seeded, use_tqdm=False)
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert all(len(c.token_ids) == 12 for c in first.outputs)
    assert _stats(llm).num_accepted_tokens > 0
    _assert_all_free(llm)


def test_the_drafts_scratch_kv_comes_out_of_the_pool_budget(make_llm, tiny_llama_dir):
    """The draft (here the target itself) recomputes its KV in a scratch cache of max_model_len tokens (16 blocks
    of the target's size at max_model_len 256): the pool has 16 blocks fewer than without a draft."""
    def total_blocks(draft):
        llm = make_llm(tiny_llama_dir, draft=draft, num_gpu_blocks_override=None, kv_cache_memory=4 << 20)
        return llm.llm_engine.engine_core.scheduler.num_total_blocks

    assert total_blocks(None) - total_blocks(tiny_llama_dir) == 256 // 16


def test_draft_with_another_tokenizer_is_a_startup_error(make_llm, tiny_llama_dir, shallow_draft, tmp_path):
    folder = tmp_path / "other-tokenizer-draft"
    shutil.copytree(shallow_draft, folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[200:202]  # two ordinary tokens swap ids
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="draft model .*other-tokenizer-draft.* does not share the target model "
                                         ".*tiny-llama.*tokenizer"):
        make_llm(tiny_llama_dir, draft=folder)


def test_gguf_target_with_a_hugging_face_draft(make_llm, tiny_llama_gguf, shallow_draft, reference):
    """The tokenizer check compares vocabularies, not files: a GGUF target (tokenizer from its metadata) takes a
    Hugging Face draft with the same tokenizer."""
    prompts, expected = reference
    llm = make_llm(tiny_llama_gguf, draft=shallow_draft)
    assert _tokens(llm.generate(prompts, GREEDY_16, use_tqdm=False)) == expected
    assert _stats(llm).num_accepted_tokens > 0
