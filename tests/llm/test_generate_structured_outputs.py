"""Structured outputs through the offline LLM on the tiny random model: with a grammar even a random model's
output matches; constrained requests behave like any other under batching, preemption, chunked prefill, prefix
caching, cache salts, n > 1 and speculative decoding (n-gram, suffix, draft model); requests without a grammar in
the same batch are bitwise unchanged."""

from __future__ import annotations

import json
import math
import re

import pytest

from pagedllm import SamplingParams
from pagedllm.engine.input_processor import InvalidRequestError
from pagedllm.sampling_params import StructuredOutputsParams as S

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "pet": {"enum": ["cat", "dog"]}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"[a-c]{2}-[0-9]{3}"
CHOICES = ["yes", "no", "maybe"]
PROMPTS = ["Hello world", "The quick brown fox", "A language model", "Numbers like 12345"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def llm(make_llm, tiny_llama_dir):
    return make_llm(tiny_llama_dir)


def _params(temperature: float, **so) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=48, seed=1, structured_outputs=S(**so))


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _check_json(text: str) -> None:
    value = json.loads(text)
    assert set(value) <= {"name", "age", "pet"} and {"name", "age"} <= set(value)
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 99
    assert value.get("pet", "cat") in ("cat", "dog")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_match_their_constraint(llm, temperature):
    kinds = [dict(json=SCHEMA, disable_any_whitespace=True), dict(regex=REGEX), dict(choice=CHOICES)]
    params = [_params(temperature, **kind) for kind in kinds for _ in PROMPTS[:2]]
    outputs = llm.generate(PROMPTS[:2] * 3, params, use_tqdm=False)
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion
        if i < 2:
            _check_json(completion.text)
        elif i < 4:
            assert re.fullmatch(REGEX, completion.text)
        else:
            assert completion.text in CHOICES


def test_n_children_each_follow_the_grammar(llm):
    (output,) = llm.generate(["Hello"], SamplingParams(n=4, temperature=1.0, max_tokens=8,
                                                       structured_outputs=S(choice=CHOICES)), use_tqdm=False)
    assert len(output.outputs) == 4 and all(c.text in CHOICES for c in output.outputs)


def test_rows_without_a_grammar_are_bitwise_unchanged(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    alone = llm.generate(PROMPTS[:1], plain, use_tqdm=False)[0].outputs[0]
    mixed = llm.generate(PROMPTS, [plain, _params(0.0, regex=REGEX), _params(1.0, choice=CHOICES),
                                   _params(0.0, json=SCHEMA, disable_any_whitespace=True)], use_tqdm=False)
    batched = mixed[0].outputs[0]
    assert batched.token_ids == alone.token_ids
    assert batched.logprobs == alone.logprobs  # the same floats, bit for bit


def test_logprobs_see_the_masked_logits(llm, tiny_tokenizer):
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5, structured_outputs=S(choice=["yes", "no"]))
    completion = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
    first = completion.logprobs[0]  # token id -> Logprob: the chosen token and the top 5
    allowed = [t for t, lp in first.items() if math.isfinite(lp.logprob)]
    assert allowed and all(any(c.startswith(tiny_tokenizer.decode([t])) for c in ("yes", "no")) for t in allowed)
    # every token of the vocabulary but the few allowed ones has probability 0: the allowed ones sum to 1
    assert math.isclose(sum(math.exp(first[t].logprob) for t in allowed), 1.0, rel_tol=1e-4)


@pytest.mark.parametrize("engine_args", [
    dict(num_gpu_blocks_override=6, max_model_len=96),  # 96 tokens; the JSON and plain requests need 56 + 67
    dict(max_num_batched_tokens=8, max_model_len=256),  # chunked prefill: prompts arrive in chunks of <= 8
    dict(enable_prefix_caching=False),
    # pipeline stages, pp steps in flight: the last applies the bitmask and samples; the others get its tokens (one
    # or several per request with speculation) in the next scheduler output, through chunked prefill and preemption
    pytest.param(dict(pipeline_parallel_size=2, max_num_batched_tokens=8, max_model_len=256, speculative_config=NGRAM),
                 marks=pytest.mark.slow),
    pytest.param(dict(pipeline_parallel_size=3, num_gpu_blocks_override=6, max_model_len=96), marks=pytest.mark.slow),
])
def test_greedy_output_is_the_same_under_other_engine_settings(make_llm, tiny_llama_dir, llm, engine_args):
    """Preemption, chunked prefill, no prefix caching, pipeline parallelism (with n-gram speculation)."""
    prompts = [p * 3 for p in PROMPTS]
    params = [_params(0.0, json=SCHEMA, disable_any_whitespace=True), _params(0.0, regex=REGEX),
              _params(0.0, choice=CHOICES), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)]
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    other = make_llm(tiny_llama_dir, **engine_args)
    try:
        outputs = other.generate(prompts, params, use_tqdm=False)
    finally:
        other.llm_engine.engine_core.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == reference
    if "num_gpu_blocks_override" in engine_args:
        assert other.llm_engine.engine_core.scheduler.num_preemptions > 0


SPEC_PROMPTS = ['{"name":"ab","age":12} {"name":"cd","age":34} ', "ab-123 bc-234 ca-345 ", "yes no maybe yes no maybe "]
"""Prompts that hold text of the grammars below (JSON, REGEX, CHOICES), so the n-gram proposer drafts tokens they
allow."""


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", pytest.param("ngram-mp", marks=pytest.mark.slow)])
def test_constrained_requests_speculate_with_the_same_greedy_output(make_llm, tiny_llama_dir, llm, method):
    """A constrained request's drafts are cut where its grammar refuses them, and each verify row is masked with
    the grammar after the drafts before it: greedy output equals speculation off, constrained requests on their own
    and batched with a plain request, while their drafts were verified and accepted. draft_model: the target drafts
    for itself, so every draft the grammar allows is its masked argmax too and must be accepted. ngram-mp: the
    verify rows' bitmask crosses to the worker process (ExecuteModel)."""
    constrained = [_params(0.0, json=SCHEMA, disable_any_whitespace=True), _params(0.0, regex=REGEX),
                   _params(0.0, choice=CHOICES)]
    params = constrained + [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    prompts = SPEC_PROMPTS + [PROMPTS[1] * 3]
    reference = _tokens(llm.generate(prompts, params, use_tqdm=False))
    if method == "draft_model":
        spec_llm = make_llm(tiny_llama_dir, draft=tiny_llama_dir)
    elif method == "suffix":
        spec_llm = make_llm(tiny_llama_dir, speculative_config={"method": "suffix", "num_speculative_tokens": 3})
    else:
        backend = "mp" if method == "ngram-mp" else "uni"
        spec_llm = make_llm(tiny_llama_dir, speculative_config=NGRAM, distributed_executor_backend=backend)
    try:
        assert _tokens(spec_llm.generate(prompts[:3], constrained, use_tqdm=False)) == reference[:3]
        stats = spec_llm.llm_engine.engine_core.scheduler.spec_decoding_totals
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
        if method == "draft_model":
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert _tokens(spec_llm.generate(prompts, params, use_tqdm=False)) == reference
        scheduler = spec_llm.llm_engine.engine_core.scheduler
        assert scheduler.num_free_blocks == scheduler.num_total_blocks
    finally:
        spec_llm.llm_engine.engine_core.shutdown()


def test_cache_salts_with_structured_outputs(llm):
    """A constrained request under a cache salt gives the output it gives without one, and hits only the prefix-cache
    blocks of its own salt."""
    prompt = list(range(3, 43))  # 40 tokens: 2 full blocks of 16

    def run(salt):
        (out,) = llm.generate({"prompt_token_ids": prompt, "cache_salt": salt}, _params(0.0, regex=REGEX),
                              use_tqdm=False)
        return out.outputs[0].token_ids, out.num_cached_tokens

    unsalted, alice, bob, alice_again = run(None), run("alice"), run("bob"), run("alice")
    assert re.fullmatch(REGEX, llm.get_tokenizer().decode(unsalted[0], skip_special_tokens=True))
    assert unsalted[0] == alice[0] == bob[0] == alice_again[0]
    assert (unsalted[1], alice[1], bob[1], alice_again[1]) == (0, 0, 0, 32)


def test_bad_constraints_are_refused_before_queueing(llm):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["x"], SamplingParams(structured_outputs=S(regex="a(b")), use_tqdm=False)
    assert info.value.param == "structured_outputs.regex"
    assert not llm.llm_engine.engine_core.has_unfinished_requests()


def test_chat_takes_structured_outputs(llm):
    out = llm.chat([{"role": "user", "content": "Yes or no?"}],
                   SamplingParams(temperature=1.0, max_tokens=8, structured_outputs=S(choice=CHOICES)), use_tqdm=False)
    assert out[0].outputs[0].text in CHOICES
