"""The offline LLM against transformers, and DESIGN invariant 2 (batching never changes greedy output)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams

GREEDY_16 = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _llm(model_dir, **kwargs):
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("max_model_len", 512)
    kwargs.setdefault("num_gpu_blocks_override", 512)
    return LLM(str(model_dir), **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return _llm(tiny_llama_dir)


def _hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(num_tokens):
            next_id = int(model(ids).logits[0, -1].argmax())
            out.append(next_id)
            ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    return out


@pytest.mark.slow  # tens of seconds: out of the fast run (-m "not slow"), still in CI
def test_greedy_matches_transformers_token_for_token(llm, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    rng = random.Random(0)
    vocab = hf.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(3, 40))] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ours = _tokens(llm.generate(prompts, params, use_tqdm=False))
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == _hf_greedy(hf, prompt, 32)


def _mixed_prompts(vocab: int) -> list[list[int]]:
    """32 prompts of 5-150 tokens; half share a 48-token prefix so the prefix cache has work to do."""
    rng = random.Random(1)
    shared = [rng.randrange(vocab) for _ in range(48)]
    prompts = []
    for i in range(32):
        body = [rng.randrange(vocab) for _ in range(rng.randrange(5, 100))]
        prompts.append(shared + body if i % 2 else body)
    return prompts


@pytest.mark.slow  # tens of seconds: out of the fast run (-m "not slow"), still in CI
def test_batching_never_changes_greedy_output(tiny_llama_dir):
    """DESIGN invariant 2: alone, batched, prefix caching on/off, chunked, preempted: identical."""
    llm = _llm(tiny_llama_dir)
    prompts = _mixed_prompts(llm.llm_engine.engine_core.vocab_size)
    alone = [_tokens(llm.generate([p], GREEDY_16, use_tqdm=False))[0] for p in prompts]
    batched = _tokens(llm.generate(prompts, GREEDY_16, use_tqdm=False))
    assert batched == alone
    assert _tokens(_llm(tiny_llama_dir, enable_prefix_caching=False).generate(
        prompts, GREEDY_16, use_tqdm=False)) == alone
    chunked = _llm(tiny_llama_dir, max_num_batched_tokens=32)
    assert _tokens(chunked.generate(prompts, GREEDY_16, use_tqdm=False)) == alone
    # 40 blocks of 16 tokens: 32 requests of up to ~170 tokens cannot all run at once.
    small = _llm(tiny_llama_dir, num_gpu_blocks_override=40, max_model_len=256)
    assert _tokens(small.generate(prompts, GREEDY_16, use_tqdm=False)) == alone
    assert small.llm_engine.num_preemptions > 0


def test_prefix_cache_hits_on_repeated_prompt(llm):
    prompt = list(range(1, 70))
    first = llm.generate([prompt], GREEDY_16, use_tqdm=False)[0]
    second = llm.generate([prompt], GREEDY_16, use_tqdm=False)[0]
    assert second.num_cached_tokens == 64  # 4 full blocks; the last prompt token is always recomputed
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_seeded_sampling_does_not_depend_on_the_batch(llm):
    prompt = [5, 6, 7, 8, 9]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = _tokens(llm.generate([prompt], seeded, use_tqdm=False))[0]
    others = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.3, seed=7, top_k=20, max_tokens=16, ignore_eos=True)]
    batch = llm.generate([[1, 2, 3], prompt, list(range(10, 60)), [4] * 9], [others[0], seeded, *others[1:]],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=16, ignore_eos=True)
    assert _tokens(llm.generate([prompt], different_seed, use_tqdm=False))[0] != alone


def test_n_siblings_share_the_prompt_blocks(llm):
    prompt = list(range(100, 180))
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    hits_before = kv.prefix_cache_hits
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # siblings sample with different seeds
    # siblings 1 and 2 hit the 4 full blocks (64 tokens) child 0 cached; the 80th token is recomputed
    assert kv.prefix_cache_hits - hits_before == 2 * 64


def test_stop_string_and_outputs_in_input_order(llm):
    prompts = ["hello world", "the cat", "a"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    text = outs[0].outputs[0].text
    assert len(text) > 3, text  # 12 tokens of this vocabulary (before: a shorter text skipped the stop check)
    stop = text[1:3]
    (stopped,) = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                              stop=[stop]), use_tqdm=False)
    assert stopped.outputs[0].text == text[:text.index(stop)]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop


FIXTURE = Path(__file__).parent.parent / "fixtures" / "smollm2_greedy_fp32.json"


@pytest.mark.slow
def test_smollm2_gguf_greedy_matches_reference():
    reference = json.loads(FIXTURE.read_text())
    llm = LLM(dtype="float32", max_model_len=1024, kv_cache_memory=64 << 20)
    tokenizer = llm.get_tokenizer()
    cases = reference["cases"]
    for case in cases:
        if case["kind"] == "chat":
            text = tokenizer.apply_chat_template(case["messages"], tokenize=False, add_generation_prompt=True)
            assert text == case["prompt_text"]
        assert tokenizer.encode(case["prompt_text"], add_special_tokens=False) == case["prompt_ids"]
    prompts = [c["prompt_ids"] for c in cases]
    stop_at_eos = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    assert _tokens(stop_at_eos) == [c["output_ids"] for c in cases]
    assert [o.outputs[0].text for o in stop_at_eos] == [c["output_text"].removesuffix("<|im_end|>")
                                                        for c in cases]
    # the reference masks EOS for all 32 tokens (HF min_new_tokens); min_tokens does the same
    ignore_eos = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32),
                              use_tqdm=False)
    assert _tokens(ignore_eos) == [c["output_ids_ignore_eos"] for c in cases]


def test_logprobs_and_prompt_logprobs_match_transformers(llm, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    prompt = list(range(3, 40))
    llm.generate([prompt], GREEDY_16, use_tqdm=False)  # cache the prompt: prompt logprobs must not use it
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    completion = out.outputs[0]
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)  # [L, V]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry[prompt[pos]].logprob == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4)
        top = torch.topk(ref[pos - 1], 3).indices.tolist()
        assert set(top) <= set(entry)
    logprob_sum = 0.0
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert entry[token].rank == 1 and entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert set(torch.topk(row, 5).indices.tolist()) <= set(entry)
        logprob_sum += float(row[token])
    assert completion.cumulative_logprob == pytest.approx(logprob_sum, abs=1e-3)


def test_generation_config_defaults_apply_when_no_params_are_given(llm):
    """vLLM's --generation-config auto: the tiny model's generation_config.json sets temperature/top_p."""
    defaults = llm.llm_engine.input_processor.default_sampling_params()
    assert (defaults.temperature, defaults.top_p) == (0.7, 0.9)
    (out,) = llm.generate(["hello"], use_tqdm=False)
    assert len(out.outputs[0].token_ids) == defaults.max_tokens == 16 or out.outputs[0].finish_reason == "stop"


def test_chat_renders_the_template_for_one_or_many_conversations(llm):
    tokenizer = llm.get_tokenizer()
    conversation = [{"role": "user", "content": "hello there"}]
    (one,) = llm.chat(conversation, GREEDY_16, use_tqdm=False)
    expected = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert one.prompt == expected
    (direct,) = llm.generate([tokenizer.encode(expected, add_special_tokens=False)], GREEDY_16, use_tqdm=False)
    assert one.outputs[0].token_ids == direct.outputs[0].token_ids
    many = llm.chat([conversation, [{"role": "user", "content": "the cat"}]], GREEDY_16, use_tqdm=False)
    assert len(many) == 2 and many[0].outputs[0].token_ids == one.outputs[0].token_ids
