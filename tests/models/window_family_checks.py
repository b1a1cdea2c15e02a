"""Shared checks for the families with sliding-window attention (tests/models/test_mistral_family.py,
test_gemma2_family.py): tiny random models built with transformers' own classes, fp32, greedy, prompts longer than
the window (12 tokens) and generation past it, against transformers; a divergence is allowed only where the
reference's top-2 logit gap is below 1e-4."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from pagedllm import LLM, SamplingParams

GAP = 1e-4
NEW_TOKENS = 16
WINDOW = 12
FP8_GAP = 0.5  # twice the largest logit change fp8 KV makes here: a divergence below it is fp8's, not a bug
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def save(folder: Path, model) -> None:
    """Norm weights random around 1 (or 0 for Gemma's 1 + w norms: `_save` cannot tell, so both get +-0.5 of
    noise), every other parameter as transformers initialized it; then safetensors."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.empty_like(p).uniform_(-0.5, 0.5))
    model.save_pretrained(folder, safe_serialization=True)


def reference(hf, prompt: list[int], num_tokens: int = NEW_TOKENS) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens (its generate, with its own sliding-window cache) and at each the top-2 gap of
    its raw logits."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=num_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
    ids = torch.tensor([prompt])
    with torch.no_grad():  # an explicit mask: a prompt token equal to pad_token_id is not padding
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    tops = [logits[0].topk(2) for logits in out.logits]
    return out.sequences[0, len(prompt):].tolist(), [float(t.values[0] - t.values[1]) for t in tops]


def assert_matches(got: list[int], want: tuple[list[int], list[float]], gap: float = GAP) -> None:
    tokens, gaps = want
    for i, (a, b) in enumerate(zip(got, tokens, strict=True)):
        if a != b:
            assert gaps[i] < gap, f"token {i}: {a} != transformers' {b} (top-2 gap {gaps[i]:.2e})\n{got}\n{tokens}"
            return  # past a near-tie the continuations may differ


def prompts(vocab: int) -> list[list[int]]:
    """4 prompts of 40-70 tokens (3-5 windows, 3-5 KV blocks of 16) sharing a 36-token prefix; the last repeats a
    motif (n-gram drafts get proposed and accepted)."""
    rng = random.Random(0)
    shared = [rng.randrange(vocab) for _ in range(36)]
    out = [shared + [rng.randrange(vocab) for _ in range(rng.randrange(4, 34))] for _ in range(3)]
    motif = [rng.randrange(vocab) for _ in range(5)]
    return out + [shared + motif * 5]


def llm(folder: Path, **kwargs) -> LLM:
    kwargs.setdefault("num_gpu_blocks_override", 128)
    kwargs.setdefault("max_model_len", 256)
    return LLM(str(folder), dtype="float32", **kwargs)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def check_engine_paths(folder: Path, hf, ps: list[list[int]] | None = None, small_blocks: int = 10,
                       small_len: int = 128, small_budget: int = 64) -> None:
    """transformers' greedy tokens through a batch with n=2, the same batch again (prefix cache hits mid-sequence,
    past the window), chunked prefill (16-token budget), preemption (a `small_blocks`-block pool, max_model_len
    `small_len`, a `small_budget`-token step: a sliding group holds its window and a step's tokens), then fp8 KV
    cache and n-gram speculative decoding against the same engine without them:
    speculation gives the same tokens bit for bit; fp8 KV the same tokens within itself alone and batched, and
    transformers' up to its first top-2 gap below FP8_GAP (e4m3 K/V move these models' prefill logits by up to
    0.26, Gemma 2, and 0.18, Mistral). `ps`: the prompts (default `prompts`: 36 tokens shared, each at most 256)."""
    ps = ps or prompts(hf.config.vocab_size)
    want = [reference(hf, p) for p in ps]
    base = llm(folder)
    for run in range(2):
        outputs = base.generate(ps, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, n=2),
                                use_tqdm=False)
        if run == 1:
            assert all(o.num_cached_tokens >= 32 for o in outputs)  # a prefix cache hit, past the window
        for out, ref in zip(outputs, want, strict=True):
            assert len(out.outputs) == 2
            for completion in out.outputs:
                assert_matches(list(completion.token_ids), ref)
    plain = tokens(base.generate(ps, GREEDY, use_tqdm=False))
    chunked = llm(folder, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=False)
    for got, ref in zip(tokens(chunked.generate(ps, GREEDY, use_tqdm=False)), want, strict=True):
        assert_matches(got, ref)
    small = llm(folder, num_gpu_blocks_override=small_blocks, max_model_len=small_len,
                max_num_batched_tokens=small_budget)
    for got, ref in zip(tokens(small.generate(ps, GREEDY, use_tqdm=False)), want, strict=True):
        assert_matches(got, ref)
    assert small.llm_engine.num_preemptions > 0
    spec = llm(folder, speculative_config=NGRAM)
    assert tokens(spec.generate(ps, GREEDY, use_tqdm=False)) == plain
    assert spec.llm_engine.engine_core.scheduler.spec_decoding_totals.num_draft_tokens > 0  # verify rows ran
    fp8 = llm(folder, kv_cache_dtype="fp8")
    batched = tokens(fp8.generate(ps, GREEDY, use_tqdm=False))
    assert [tokens(fp8.generate([p], GREEDY, use_tqdm=False))[0] for p in ps] == batched
    for got, ref in zip(batched, want, strict=True):
        assert_matches(got, ref, gap=FP8_GAP)


def check_pipeline_parallel(folder: Path, vocab: int, ps: list[list[int]] | None = None) -> None:
    """PP=2 (the layers split in two, each stage a worker process) gives the one-stage engine's greedy tokens bit
    for bit: `ps` (default those of `prompts`), past any window, n=1, the second pass hitting the prefix cache."""
    ps = ps or prompts(vocab)
    want = tokens(llm(folder).generate(ps, GREEDY, use_tqdm=False))
    engine = llm(folder, pipeline_parallel_size=2)
    try:
        for _ in range(2):
            assert tokens(engine.generate(ps, GREEDY, use_tqdm=False)) == want
    finally:
        engine.llm_engine.engine_core.shutdown()


def check_tensor_parallel(folder: Path, hf, ps: list[list[int]] | None = None) -> None:
    """TP=2 (heads, KV heads and the MLP split across two worker processes) gives transformers' greedy tokens on
    two prompts (of `ps`, default `prompts`)."""
    ps = (ps or prompts(hf.config.vocab_size))[:2]
    engine = llm(folder, tensor_parallel_size=2)
    try:
        outputs = engine.generate(ps, GREEDY, use_tqdm=False)
    finally:
        engine.llm_engine.engine_core.shutdown()
    for got, p in zip(tokens(outputs), ps, strict=True):
        assert_matches(got, reference(hf, p))


def check_native_step_declines(folder: Path, caplog, reason: str) -> None:
    """With native-kernel weights (fp8) the native decode step is not built, and the load log says why in one
    line: `reason` after "the native decode step has no" (the family's layers), or, for a model whose layers form
    several KV cache groups, `reason` in the runner's line saying the step reads one block table."""
    import logging

    with caplog.at_level(logging.INFO, logger="pagedllm"):
        engine = llm(folder, quantization="fp8")
    runner = engine.llm_engine.engine_core.runner
    assert runner.native_step is None
    name = type(runner.model).__name__
    assert (f"{name}: the native decode step has no {reason}" in caplog.text
            or (f"{name}: {reason}" in caplog.text and "the native decode step reads one block table" in caplog.text))
