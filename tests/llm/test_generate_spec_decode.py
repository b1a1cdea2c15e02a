"""Speculative decoding end to end: greedy output with n-gram drafts is bit-identical to plain decoding (alone,
batched, prefix caching off, chunked, preempted), stops inside an accepted run, n > 1 and seeded sampling work,
and every block is free at the end (DESIGN invariants 1 and 2)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.acceptance_guard import DraftAcceptance, VerifyCost

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}
GREEDY_24 = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _prompts(vocab: int) -> list[list[int]]:
    """Prompts that repeat themselves (drafts get proposed and some accepted) and random ones; a shared prefix."""
    rng = random.Random(5)
    shared = [rng.randrange(vocab) for _ in range(40)]
    prompts = []
    for i in range(12):
        motif = [rng.randrange(vocab) for _ in range(rng.randrange(3, 9))]
        body = motif * rng.randrange(2, 8) if i % 3 else [rng.randrange(vocab) for _ in range(rng.randrange(5, 60))]
        prompts.append(shared + body if i % 2 else body)
    return prompts


def _spec_stats(llm: LLM):
    return llm.llm_engine.engine_core.scheduler.spec_decoding_totals


def _assert_all_free(llm: LLM) -> None:
    scheduler = llm.llm_engine.engine_core.scheduler
    assert scheduler.num_free_blocks == scheduler.num_total_blocks


@pytest.fixture(scope="module")
def reference(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    prompts = _prompts(llm.llm_engine.engine_core.vocab_size)
    return prompts, [_tokens(llm.generate([p], GREEDY_24, use_tqdm=False))[0] for p in prompts], llm


@pytest.mark.parametrize("spec, engine_args", [
    (NGRAM, {}),
    (NGRAM, {"enable_prefix_caching": False}),
    (NGRAM, {"max_num_batched_tokens": 24}),  # chunked prefill, and drafts trimmed to the budget
    (NGRAM, {"num_gpu_blocks_override": 24, "max_model_len": 128}),  # preemption
    (SUFFIX, {}),
    (SUFFIX, {"num_gpu_blocks_override": 24, "max_model_len": 128}),
], ids=["default", "no-prefix-caching", "chunked", "preempted", "suffix", "suffix-preempted"])
def test_greedy_output_is_bit_identical_with_speculation(make_llm, tiny_llama_dir, reference, spec, engine_args):
    prompts, expected, _ = reference
    llm = make_llm(tiny_llama_dir, speculative_config=spec, **engine_args)
    assert _tokens(llm.generate(prompts, GREEDY_24, use_tqdm=False)) == expected  # batched
    if not engine_args:
        assert [_tokens(llm.generate([p], GREEDY_24, use_tqdm=False))[0] for p in prompts] == expected  # alone
        verify_cost = llm.llm_engine.engine_core.scheduler.verify_cost  # measured at batch 1 (the default)
        assert verify_cost.value != VerifyCost.MEASURED_PRIOR and 0 <= verify_cost.value <= VerifyCost.MAX_ESTIMATE
    stats = _spec_stats(llm)
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0  # the test exercised both outcomes
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    if "num_gpu_blocks_override" in engine_args:
        assert llm.llm_engine.num_preemptions > 0
    _assert_all_free(llm)


def test_greedy_output_is_bit_identical_while_the_guard_turns_drafting_off_and_on(make_llm, tiny_llama_dir, reference,
                                                                                 monkeypatch):
    """The low-acceptance guard (on by default) stops and restarts drafting within a request as its acceptance
    moves; the output stays the plain one, alone and batched, and only verified drafts are counted."""
    prompts, expected, _ = reference
    decisions: dict[int, list[int]] = {}
    choose = DraftAcceptance.num_drafts

    def spy(self, cost):
        d = choose(self, cost)
        decisions.setdefault(id(self), []).append(d)
        return d

    monkeypatch.setattr(DraftAcceptance, "num_drafts", spy)
    # a fixed cost: the measured one (the default) depends on the machine's step times, and so would the guard's
    # decisions this test needs
    llm = make_llm(tiny_llama_dir, speculative_config=dict(NGRAM, verify_cost_per_draft_token=0.33))
    assert [_tokens(llm.generate([p], GREEDY_24, use_tqdm=False))[0] for p in prompts] == expected
    assert _tokens(llm.generate(prompts, GREEDY_24, use_tqdm=False)) == expected
    def on_off_on(d: list[int]) -> bool:
        on = next((i for i, n in enumerate(d) if n), len(d))
        off = next((i for i in range(on, len(d)) if d[i] == 0), len(d))
        return any(d[off:])

    assert any(on_off_on(d) for d in decisions.values())  # a request stopped drafting and started again
    assert 0 < _spec_stats(llm).num_draft_tokens <= sum(sum(d) for d in decisions.values())  # trims cut some
    _assert_all_free(llm)


def test_stop_inside_an_accepted_run_n_siblings_and_seeds(make_llm, tiny_llama_dir, reference):
    prompts, expected, plain = reference
    llm = make_llm(tiny_llama_dir, speculative_config=NGRAM)
    # a stop token that greedy decoding reaches after a few tokens: output ends there, as without speculation
    i = next(i for i, e in enumerate(expected) if len(set(e[3:])) < len(e[3:]))
    stop_token = expected[i][5]
    (out,) = llm.generate([prompts[i]], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_token]),
                          use_tqdm=False)
    assert out.outputs[0].token_ids == expected[i][:expected[i].index(stop_token) + 1]
    assert out.outputs[0].finish_reason == "stop"
    # stop strings completed late in the output (after accepted runs): same text and tokens as without speculation
    accepted_before = _spec_stats(llm).num_accepted_tokens
    tokenizer = plain.get_tokenizer()
    stops = [SamplingParams(temperature=0.0, max_tokens=24, stop=[tokenizer.decode(e[-5:])[1:4]]) for e in expected]
    with_spec = llm.generate(prompts, stops, use_tqdm=False)
    without = plain.generate(prompts, stops, use_tqdm=False)
    assert _spec_stats(llm).num_accepted_tokens > accepted_before
    assert [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].stop_reason) for o in with_spec] == \
        [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].stop_reason) for o in without]
    assert sum(o.outputs[0].finish_reason == "stop" for o in without) >= len(prompts) // 2
    (short,) = llm.generate([prompts[i]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                            use_tqdm=False)
    assert short.outputs[0].token_ids == expected[i][:3]  # max_tokens trims the drafts
    seeded = SamplingParams(n=3, temperature=1.0, top_k=20, seed=11, max_tokens=16, ignore_eos=True)
    drafts_before = _spec_stats(llm).num_draft_tokens
    (first,) = llm.generate([prompts[1]], seeded, use_tqdm=False)
    assert _spec_stats(llm).num_draft_tokens > drafts_before
    # the measured cost moves with the machine's timing; a seeded request's tokens must not
    llm.llm_engine.engine_core.scheduler.verify_cost.value = VerifyCost.MAX_ESTIMATE
    (again,) = llm.generate([prompts[1]], seeded, use_tqdm=False)
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert all(len(c.token_ids) == 16 for c in first.outputs)
    # options the verifier does not support run without drafts, and still work
    drafts_before = _spec_stats(llm).num_draft_tokens
    (penalised,) = llm.generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3),
                                use_tqdm=False)
    assert len(penalised.outputs[0].token_ids) == 8
    assert _spec_stats(llm).num_draft_tokens == drafts_before
    _assert_all_free(llm)


def test_suffix_decoding_learns_a_repeated_output_across_requests(make_llm, tiny_llama_dir, reference):
    """A loop that asks for the same structured output again and again (an agent's tool call): from the second
    request on, the global tree of past outputs drafts it, so nearly every draft is accepted; without the global
    tree (max_cached_requests 0) only the request's own repeats are drafted. The low-acceptance guard is off: it
    would verify fewer drafts while each new request's estimate ramps up, which is not what this test is about."""
    prompts, expected, _ = reference
    prompt = prompts[0]  # a random prompt: its greedy output does not repeat itself much
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = {}
    for cached in (0, 100):
        llm = make_llm(tiny_llama_dir, speculative_config=dict(SUFFIX, suffix_decoding_max_cached_requests=cached,
                                                               verify_cost_per_draft_token=0))
        outputs = [_tokens(llm.generate([prompt], params, use_tqdm=False))[0] for _ in range(3)]
        assert outputs == [expected[0]] * 3
        stats = _spec_stats(llm)
        results[cached] = (stats.num_draft_tokens, stats.num_accepted_tokens)
        _assert_all_free(llm)
    drafts, accepted = results[100]
    assert drafts >= 2 * 20 and accepted >= 0.8 * drafts  # requests 2 and 3 draft (nearly) their whole output
    assert accepted >= results[0][1] + 12  # measured: 42 vs 24 accepted


def _generate_salted(llm: LLM, prompt: list[int], params: SamplingParams, salt: str | None):
    (output,) = llm.generate({"prompt_token_ids": prompt, "cache_salt": salt}, params, use_tqdm=False)
    return output.outputs[0].token_ids, output.num_cached_tokens


def test_cache_salts_and_options_without_speculation(make_llm, tiny_llama_dir, reference):
    """Speculation with cache salts: the same prompt under different salts gives the speculation-off output and
    never hits another salt's blocks. Requests whose options the verifier does not support (penalties,
    min_tokens, logit_bias, logprobs) get no drafts and the plain output."""
    prompts, expected, plain = reference
    i = next(i for i, p in enumerate(prompts) if len(p) >= 40)
    llm = make_llm(tiny_llama_dir, speculative_config=SUFFIX)
    assert _generate_salted(llm, prompts[i], GREEDY_24, "alice") == (expected[i], 0)
    assert _generate_salted(llm, prompts[i], GREEDY_24, "bob") == (expected[i], 0)  # no cross-salt hit
    assert _generate_salted(llm, prompts[i], GREEDY_24, None) == (expected[i], 0)
    tokens, cached = _generate_salted(llm, prompts[i], GREEDY_24, "alice")
    assert tokens == expected[i] and cached >= 32  # the same salt hits its own full prompt blocks
    assert _spec_stats(llm).num_accepted_tokens > 0
    _assert_all_free(llm)

    drafts_before = _spec_stats(llm).num_draft_tokens
    options = [dict(presence_penalty=0.5), dict(frequency_penalty=0.5), dict(repetition_penalty=1.3),
               dict(min_tokens=4), dict(logit_bias={5: 3.0}), dict(logprobs=2), dict(prompt_logprobs=1)]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **o) for o in options]
    with_spec = llm.generate([prompts[1]] * len(params), params, use_tqdm=False)
    without = plain.generate([prompts[1]] * len(params), params, use_tqdm=False)
    assert _tokens(with_spec) == _tokens(without)
    assert _spec_stats(llm).num_draft_tokens == drafts_before
    _assert_all_free(llm)


def test_disable_by_batch_size_end_to_end(make_llm, tiny_llama_dir, reference):
    """Two requests decoding together reach disable_by_batch_size 2: no drafts at all; one alone gets drafts."""
    prompts, expected, _ = reference
    repeating = [i for i, p in enumerate(prompts) if i % 3][:2]  # prompts that repeat themselves: drafts exist
    llm = make_llm(tiny_llama_dir, speculative_config=dict(NGRAM, disable_by_batch_size=2))
    assert _tokens(llm.generate([prompts[i] for i in repeating], GREEDY_24, use_tqdm=False)) == \
        [expected[i] for i in repeating]
    assert _spec_stats(llm).num_draft_tokens == 0
    assert _tokens(llm.generate([prompts[repeating[0]]], GREEDY_24, use_tqdm=False)) == [expected[repeating[0]]]
    assert _spec_stats(llm).num_draft_tokens > 0


FIXTURE = Path(__file__).parent.parent / "fixtures" / "smollm2_greedy_fp32.json"


@pytest.mark.slow
def test_smollm2_greedy_with_speculation_matches_reference_and_plain_decoding():
    cases = json.loads(FIXTURE.read_text())["cases"]
    rng = random.Random(3)
    randoms = [[rng.randrange(49152) for _ in range(rng.randrange(4, 40))] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    to_eos = SamplingParams(temperature=0.0, max_tokens=32)  # the reference's output_ids stop at EOS
    kwargs = dict(dtype="float32", max_model_len=1024, kv_cache_memory=64 << 20)
    plain = _tokens(LLM(**kwargs).generate(randoms, params, use_tqdm=False))
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                  "prompt_lookup_max": 4}, **kwargs)
    prompts = [c["prompt_ids"] for c in cases]
    assert _tokens(llm.generate(prompts, to_eos, use_tqdm=False)) == [c["output_ids"] for c in cases]
    assert _tokens(llm.generate(prompts[:1], to_eos, use_tqdm=False)) == [cases[0]["output_ids"]]
    assert _tokens(llm.generate(randoms, params, use_tqdm=False)) == plain
    assert _spec_stats(llm).num_accepted_tokens > 0
