"""A model whose vocab_size is padded past its tokenizer (Qwen2.5: 151,936 rows over 151,665 tokens; here 512 over
384) through the offline LLM: an id the tokenizer lacks decodes to "" in the text and in the logprobs, as in vLLM.
vLLM does not mask such ids out of sampling (its logits keep every row of the config's vocab_size), and neither
does pagedllm: they are sampled as the model scores them."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

TOKENIZER_SIZE, PADDED_ID = 384, 500


@pytest.fixture(scope="module")
def llm(tiny_llama_padded_dir):
    return LLM(str(tiny_llama_padded_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=64)


def test_a_forced_padded_id_decodes_to_nothing_with_its_logprobs(llm):
    tokenizer = llm.get_tokenizer()
    assert len(tokenizer) == TOKENIZER_SIZE
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={PADDED_ID: 100.0},
                            logprobs=3)
    (out,) = llm.generate(["The quick brown fox"], params, use_tqdm=False)[0].outputs
    assert list(out.token_ids) == [PADDED_ID] * 4 and out.text == ""
    for position in out.logprobs:
        # ranked among the raw logprobs (vLLM's default --logprobs-mode): before its logit_bias, so not first
        assert position[PADDED_ID].decoded_token == "" and position[PADDED_ID].rank >= 1
        assert len(position) >= 3 and all(isinstance(lp.decoded_token, str) for lp in position.values())


def test_padded_ids_are_not_masked_and_decode_among_real_tokens(llm):
    """The padded rows are sampled as the model scores them (not masked, as in vLLM); the text is the decode of the
    ids the tokenizer has, and the top logprobs name padded ids "" (the random model ranks some near the top)."""
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=48, ignore_eos=True, logprobs=5)
    outputs = llm.generate(["The quick brown fox", "Hello world"] * 4, params, use_tqdm=False)
    ids = [t for o in outputs for t in o.outputs[0].token_ids]
    assert any(t >= TOKENIZER_SIZE for t in ids)  # padded ids are sampled: not masked
    for request in outputs:
        out = request.outputs[0]
        assert out.text == tokenizer.decode([t for t in out.token_ids if t < TOKENIZER_SIZE])
        for position in out.logprobs:
            for token_id, lp in position.items():
                assert lp.decoded_token == ("" if token_id >= TOKENIZER_SIZE else tokenizer.decode([token_id]))
    # a prompt with a padded id (below the model's vocab_size: accepted, as in vLLM), with prompt logprobs
    prompt = tokenizer.encode("The fox") + [PADDED_ID]
    (request,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, prompt_logprobs=1),
                              use_tqdm=False)
    assert request.prompt_logprobs[-1][PADDED_ID].decoded_token == ""
