"""vLLM's rules for fields that only make sense together (stream_options needs stream, prompt_logprobs excludes
it, a seed must leave room for n choices), the cap on prompts x n, and HEAD /health, against one real server."""

from __future__ import annotations

import pytest
from reliability_utils import MODEL_NAME, assert_error_body, assert_server_intact

pytestmark = pytest.mark.slow

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


def _body(path: str, **fields) -> dict:
    prompt = {"prompt": "hello there"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "hi"}]}
    return {"model": MODEL_NAME, **prompt, "max_tokens": 2, **fields}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_stream_options_need_stream(server, path):
    for stream in ({}, {"stream": False}):
        response = server.http.post(path, json=_body(path, stream_options={"include_usage": True}, **stream))
        error = assert_error_body(response, 400, "stream_options")  # before: 200, the options ignored
        assert error["message"] == "Stream options can only be defined when `stream=True`."
    assert server.http.post(path, json=_body(path, stream_options=None)).status_code == 200
    streamed = server.http.post(path, json=_body(path, stream=True, stream_options={"include_usage": True}))
    assert streamed.status_code == 200 and '"usage":{"prompt_tokens"' in streamed.text.replace(" ", "")


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_prompt_logprobs_exclude_stream(server, path):
    response = server.http.post(path, json=_body(path, stream=True, prompt_logprobs=1))
    error = assert_error_body(response, 400, "prompt_logprobs")
    assert error["message"] == "`prompt_logprobs` are not available when `stream=True`."


def test_seed_overflow_names_the_seed_sent_and_n(server):
    top = 2**64 - 1
    response = server.http.post(COMPLETIONS, json=_body(COMPLETIONS, seed=top, n=2))
    message = assert_error_body(response, 400, "seed")["message"]
    # before: "seed 18446744073709551616 does not fit in 64 bits." (a seed nobody sent: choice 1's)
    assert str(top) in message and "n=2" in message and str(top - 1) in message, message
    ok = server.http.post(COMPLETIONS, json=_body(COMPLETIONS, seed=top - 1, n=2, temperature=1.0))
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    one = server.http.post(COMPLETIONS, json=_body(COMPLETIONS, seed=top, n=1, temperature=1.0))
    assert one.status_code == 200


def test_prompts_times_n_is_capped(server):
    engine_pid = server.engine_pid()
    prompt_tokens = server.metric("vllm:prompt_tokens_total")
    response = server.http.post(COMPLETIONS, json=_body(COMPLETIONS, prompt=[f"prompt {i}" for i in range(64)],
                                                        n=128, max_tokens=16))
    message = assert_error_body(response, 400, "n")["message"]  # before: 200 after 105 s of engine time
    assert "8192 choices" in message and "1024" in message and "--max-choices" in message, message
    assert server.metric("vllm:prompt_tokens_total") == prompt_tokens  # refused before any reached the engine
    assert_server_intact(server, engine_pid)


def test_head_health_is_200(server):
    assert server.http.head("/health").status_code == 200  # before: 405
    assert server.http.get("/health").status_code == 200
