"""/tokenize and /detokenize bodies over the caps are refused on the raw JSON, before FastAPI builds them into
Python objects (a 13.8 MB prompt, a 2.8-million-id list); anything else is left to the request's own validation."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pagedllm.config import ServerConfig
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization


class OneCharTokenizer:
    chat_template = None

    def get_vocab(self) -> dict[str, int]:
        return {"ab": 0}  # the longest token: 2 characters


@pytest.fixture
def serving() -> OpenAIServingTokenization:
    engine = SimpleNamespace(tokenizer=OneCharTokenizer(), max_model_len=100)
    return OpenAIServingTokenization(engine, ["m"])


def _precheck(serving, body) -> None:
    serving.precheck(json.dumps(body).encode() if not isinstance(body, bytes) else body, ServerConfig())


def test_prompt_over_the_cap(serving):
    assert serving.max_prompt_chars == 400  # 100 tokens x 2 characters x the margin of 2
    _precheck(serving, {"prompt": "é" * 400})  # 800 bytes of UTF-8, 400 characters: in
    _precheck(serving, b'{"prompt": "' + b"\\u00e9" * 400 + b'"}')  # 2,400 bytes of escapes, 400 characters
    with pytest.raises(APIError) as info:
        _precheck(serving, {"model": "m", "prompt": "x" * 401})
    assert (info.value.param, info.value.code) == ("prompt", "context_length_exceeded")
    assert "401 characters long" in info.value.message


def test_token_list_over_max_model_len(serving):
    _precheck(serving, {"tokens": [1] * 100})
    with pytest.raises(APIError) as info:
        _precheck(serving, {"tokens": [1] * 101})
    assert (info.value.param, info.value.code) == ("tokens", "context_length_exceeded")
    assert "tokens has 101 ids" in info.value.message


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", {"prompt": 5}, {"prompt": ["x"] * 500},
                                  {"tokens": "x" * 500}, {"tokens": {"a": 1}}, {"messages": [{"x": "y" * 500}]}])
def test_other_bodies_are_left_to_validation(serving, body):
    _precheck(serving, body)
