"""prompt_logprobs through a real server, as vLLM returns them (completions: in each choice; chat: at the top
level), against transformers, and identical whether or not the prompt is in the prefix cache."""

from __future__ import annotations

import pytest
import torch
from server_utils import MODEL_NAME

pytestmark = pytest.mark.slow

PROMPT = list(range(3, 43))  # 40 tokens: two full 16-token blocks that a second request could take from the cache


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """token ids -> [L, V] log_softmax of transformers' logits (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()

    def logprobs(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)

    return logprobs


def _check_against(prompt_logprobs: list, prompt: list[int], ref: torch.Tensor, num: int, tokenizer) -> None:
    """vLLM's shape: None, then per token id (a string in JSON) {logprob, rank, decoded_token}: the prompt token
    and the top `num`."""
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        entry, row, token = prompt_logprobs[pos], ref[pos - 1], prompt[pos]
        top = torch.topk(row, num).indices.tolist()
        assert set(entry) == {str(t) for t in [token, *top]}, (pos, entry)
        chosen = entry[str(token)]
        assert chosen["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        assert chosen["rank"] == int((row > row[token]).sum()) + 1
        assert chosen["decoded_token"] == tokenizer.decode([token])
        for rank, t in enumerate(top, 1):
            assert entry[str(t)]["logprob"] == pytest.approx(float(row[t]), abs=1e-4)
            assert t == token or entry[str(t)]["rank"] == rank


def test_prompt_logprobs_are_returned_and_match_transformers(remote_server_factory, reference, tiny_llama_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    server = remote_server_factory("--block-size", "16", "--enable-prompt-tokens-details")
    greedy = {"model": MODEL_NAME, "temperature": 0.0, "max_tokens": 2}
    ref = reference(PROMPT)

    cold = server.post("/v1/completions", json={**greedy, "prompt": PROMPT, "prompt_logprobs": 3}).json()
    assert server.post("/v1/completions", json={**greedy, "prompt": PROMPT}).status_code == 200  # now cached
    warm = server.post("/v1/completions", json={**greedy, "prompt": PROMPT, "prompt_logprobs": 3}).json()
    _check_against(cold["choices"][0]["prompt_logprobs"], PROMPT, ref, 3, tokenizer)  # before: null
    # the cache holds the prompt, but prompt logprobs need every position's logits: same values, no hit
    assert warm["choices"][0]["prompt_logprobs"] == cold["choices"][0]["prompt_logprobs"]
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    two = server.post("/v1/completions", json={**greedy, "prompt": PROMPT, "prompt_logprobs": 3, "n": 2}).json()
    assert [c["prompt_logprobs"] for c in two["choices"]] == [cold["choices"][0]["prompt_logprobs"]] * 2
    plain = server.post("/v1/completions", json={**greedy, "prompt": PROMPT}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None and plain["usage"]["prompt_tokens_details"]["cached_tokens"]

    # echo with logprobs returns them too (vLLM); an explicit prompt_logprobs sets their top-N
    echo = server.post("/v1/completions", json={**greedy, "prompt": PROMPT, "echo": True, "logprobs": 4,
                                                "prompt_logprobs": 1}).json()["choices"][0]
    _check_against(echo["prompt_logprobs"], PROMPT, ref, 1, tokenizer)
    assert max(len(top) for top in echo["logprobs"]["top_logprobs"][1:len(PROMPT)]) >= 4  # the echo keeps its top-4

    chat = server.post("/v1/chat/completions", json={
        **greedy, "messages": [{"role": "user", "content": "The quick brown fox"}], "prompt_logprobs": 2,
        "return_token_ids": True}).json()
    _check_against(chat["prompt_logprobs"], chat["prompt_token_ids"], reference(chat["prompt_token_ids"]), 2,
                   tokenizer)  # before: no prompt_logprobs field
    client = server.client()
    sdk = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert len(sdk.model_extra["prompt_logprobs"]) == sdk.usage.prompt_tokens
