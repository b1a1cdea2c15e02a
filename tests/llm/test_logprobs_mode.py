"""--logprobs-mode on a tiny model, checked against transformers' logits: raw_logits returns the model's logits,
processed_logprobs the log_softmax of the logits the token is drawn from (after temperature and top-k)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai.formatting import json_logprob

PROMPT = list(range(3, 30))


@pytest.fixture(scope="module")
def hf_logits(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()

    def logits(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([tokens])).logits[0].float()  # [L, V]
    return logits


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs"])
def test_logprobs_mode_against_transformers(tiny_llama_dir, hf_logits, mode):
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
              logprobs_mode=mode)
    params = SamplingParams(temperature=0.5, top_k=3, seed=5, max_tokens=3, ignore_eos=True, logprobs=4)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    completion = out.outputs[0]
    ref = hf_logits(PROMPT + completion.token_ids)
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        row = ref[len(PROMPT) - 1 + i]
        if mode == "processed_logprobs":
            row = row / 0.5
            row = row.masked_fill(row < row.topk(3).values[-1], float("-inf")).log_softmax(-1)
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        top = row.topk(3)
        for value, tid in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            assert entry[tid].logprob == pytest.approx(value, abs=1e-4)


def test_logits_are_not_clamped_like_logprobs():
    assert json_logprob(3.5, logits=True) == 3.5 and json_logprob(3.5) == 0.0
    assert json_logprob(float("-inf"), logits=True) == -9999.0 and json_logprob(float("nan"), logits=True) == -9999.0
