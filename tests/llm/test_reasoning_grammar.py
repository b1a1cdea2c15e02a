"""A grammar that starts after the reasoning (StructuredOutputsParams.reasoning_end_token_ids, which the server's
--reasoning-parser sets) through the offline LLM, on a tiny hand-made model that closes its reasoning by itself
(thinking_model.py, `close_like`): the reasoning is sampled unconstrained (the same tokens as without a grammar),
the text after `</think>` follows the grammar (which refuses a later `</think>`), and the outputs are token-identical
with n-gram speculative decoding (drafts cut before `</think>`, verified under the grammar after it), in a batch
with unconstrained requests and with prefix caching."""

from __future__ import annotations

import json

from pagedllm import SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from thinking_model import build_thinking_model

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
MESSAGES = ["Hello world", "The quick brown fox", "Hello world"]  # the third: a prefix-cache hit
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def test_grammar_after_reasoning_with_and_without_speculation(make_llm, tiny_llama_padded_dir, tmp_path):
    folder, _, end = build_thinking_model(tiny_llama_padded_dir, tmp_path / "thinking", close_like=70)
    free = SamplingParams(temperature=0.0, max_tokens=24, skip_special_tokens=False)
    constrained = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(
        json=SCHEMA, disable_any_whitespace=True, reasoning_end_token_ids=[end]))
    runs = []
    for spec in (None, NGRAM):
        llm = make_llm(folder, speculative_config=spec)
        try:
            tokenizer = llm.get_tokenizer()
            prompts = [tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                                     tokenize=False) for m in MESSAGES]
            runs.append([o.outputs[0] for o in llm.generate(prompts * 2, [free] * 3 + [constrained] * 3,
                                                            use_tqdm=False)])
            scheduler = llm.llm_engine.engine_core.scheduler
            if spec is not None:
                assert scheduler.spec_decoding_totals.num_draft_tokens > 0
            assert scheduler.num_free_blocks == scheduler.num_total_blocks
        finally:
            llm.llm_engine.engine_core.shutdown()
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]  # speculation changes nothing
    for unconstrained, output in zip(runs[0][:3], runs[0][3:], strict=True):
        ids = list(output.token_ids)
        assert end in ids and ids[:ids.index(end) + 1] == list(unconstrained.token_ids)[:ids.index(end) + 1]
        assert end not in ids[ids.index(end) + 1:] and end in unconstrained.token_ids[ids.index(end) + 1:]
        content = output.text.split("</think>", 1)[1]
        assert content.startswith('{"a":')
        if output.finish_reason == "stop":
            json.loads(content)
