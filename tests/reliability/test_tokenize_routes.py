"""POST /tokenize and /detokenize against real servers: bounded as the generation routes are (a 13.8 MB /tokenize
held the only tokenizer thread for 10-66 s, and a two-token completion waited 9.99 s behind it), and /tokenize with
messages rendered exactly as /v1/chat/completions renders them (it took a request chat_template that chat
completions refuse, and answered 200 with the model's own template)."""

from __future__ import annotations

import threading

import pytest
from reliability_utils import MODEL_NAME, assert_error_body, assert_server_intact

from pagedllm.entrypoints.openai.serving_base import max_prompt_chars
from pagedllm.tokenizer import get_tokenizer

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512  # the tiny model's
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
TEMPLATE = ("{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
            "{% if greeting is defined %}{{ greeting }}\n{% endif %}"
            "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOL = {"type": "function", "function": {"name": "now", "description": "The time.", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["utc", "local"]}}, "required": ["tz"]}}}


@pytest.fixture(scope="module")
def server(shared_server):
    """Trusts request chat templates (conftest.py)."""
    return shared_server


@pytest.fixture(scope="module")
def engine_pid(server) -> int:
    return server.engine_pid()


@pytest.fixture(scope="module")
def untrusted(launcher):
    return launcher("--max-num-seqs", "8", name="untrusted")


@pytest.fixture(scope="module")
def cap(serve_model) -> int:
    """The longest text the servers tokenize: max_model_len tokens of the longest token, with the margin."""
    return max_prompt_chars(MAX_MODEL_LEN, get_tokenizer(str(serve_model)))


# ---- the size caps (item 4) ---------------------------------------------------------------------------------


def test_text_over_the_cap_is_refused(server, engine_pid, cap):
    """A 14 MB prompt (under the 16 MiB body cap) is refused before any tokenization, as completions refuse it;
    so are messages that render past the cap, and a text one character over it."""
    huge = "hello world " * (14_000_000 // 12)
    response = server.http.post("/tokenize", json={"model": MODEL_NAME, "prompt": huge}, timeout=120)
    error = assert_error_body(response, 400, "prompt", "context_length_exceeded")
    assert f"{len(huge)} characters long" in error["message"]
    over = ("hello world " * (cap // 12 + 1))[:cap + 1]
    for body in ({"prompt": over}, {"messages": [{"role": "user", "content": over}]}):
        assert_error_body(server.http.post("/tokenize", json=body), 400, "prompt", "context_length_exceeded")
    assert_server_intact(server, engine_pid)


def test_detokenize_refuses_more_ids_than_max_model_len(server, engine_pid):
    ok = server.http.post("/detokenize", json={"tokens": [5] * MAX_MODEL_LEN})
    assert ok.status_code == 200 and ok.json()["prompt"]
    for tokens in ([5] * (MAX_MODEL_LEN + 1), [5] * 2_800_000):  # the second: 14 MB, refused on the raw body
        error = assert_error_body(server.http.post("/detokenize", json={"tokens": tokens}, timeout=120), 400,
                                  "tokens", "context_length_exceeded")
        assert f"tokens has {len(tokens)} ids" in error["message"]
    assert_error_body(server.http.post("/detokenize", json={"tokens": [5, 384]}), 400, "tokens")  # vocab 384
    assert_server_intact(server, engine_pid)


def test_completion_during_the_largest_text_under_the_cap(server, engine_pid, cap):
    """The largest text the cap lets through is tokenized (count any length: /tokenize may exceed
    max_model_len), and a two-token completion sent meanwhile succeeds."""
    text = ("hello world " * (cap // 12 + 1))[:cap]
    result = {}

    def tokenize():
        result["response"] = server.http.post("/tokenize", json={"prompt": text, "add_special_tokens": False},
                                              timeout=120)

    worker = threading.Thread(target=tokenize)
    worker.start()
    completion = server.http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2},
                                  timeout=120)
    worker.join(120)
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 2
    tokenized = result["response"]
    assert tokenized.status_code == 200, tokenized.text[:300]
    assert tokenized.json()["count"] > MAX_MODEL_LEN and tokenized.json()["max_model_len"] == MAX_MODEL_LEN
    assert_server_intact(server, engine_pid)


# ---- messages render as chat completions render them (item 5) ------------------------------------------------


def _both_routes(server, body: dict):
    """(/tokenize's response, /v1/chat/completions' response) to one body."""
    tokenized = server.http.post("/tokenize", json=body, headers=server.headers)
    chat = server.http.post("/v1/chat/completions", headers=server.headers,
                            json={**body, "max_tokens": 1, "return_token_ids": True})
    return tokenized, chat


REFUSED_BY_BOTH = {
    "request-template": {"chat_template": TEMPLATE},
    "request-template-in-kwargs": {"chat_template_kwargs": {"chat_template": TEMPLATE}},
    "generation-prompt-and-continue": {"add_generation_prompt": True, "continue_final_message": True},
    "continue-after-user": {"add_generation_prompt": False, "continue_final_message": True},
    "no-messages": {"messages": []},
    "empty-tools": {"tools": []},
}


@pytest.mark.parametrize("changes", REFUSED_BY_BOTH.values(), ids=REFUSED_BY_BOTH.keys())
def test_untrusted_server_refuses_alike(untrusted, changes):
    """Without --trust-request-chat-template, chat completions refuse a request template (400): /tokenize took
    it and answered 200 with the model's own template. Every refusal here is the same on both routes."""
    untrusted.wait_ready()
    tokenized, chat = _both_routes(untrusted, {"model": MODEL_NAME, "messages": MESSAGES, **changes})
    error = assert_error_body(chat, 400)
    assert assert_error_body(tokenized, 400) == error
    if "chat_template" in str(changes):
        assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]


SAME_TOKENS = {
    "model-template": {},
    "request-template": {"chat_template": TEMPLATE},
    "request-template-kwargs": {"chat_template": TEMPLATE, "chat_template_kwargs": {"greeting": "Ahoy"}},
    "template-in-kwargs": {"chat_template_kwargs": {"chat_template": TEMPLATE, "greeting": "Ahoy"}},
    "no-generation-prompt": {"chat_template": TEMPLATE, "add_generation_prompt": False},
    "continue-final": {"messages": [*MESSAGES, {"role": "assistant", "content": "Hi"}],
                       "add_generation_prompt": False, "continue_final_message": True},
    "tools": {"chat_template": TEMPLATE, "tools": [TOOL], "tool_choice": "none"},
    "special-tokens": {"chat_template": TEMPLATE, "add_special_tokens": True},
}


@pytest.mark.parametrize("changes", SAME_TOKENS.values(), ids=SAME_TOKENS.keys())
def test_trusted_server_renders_alike(server, changes):
    """With the server's trust, /tokenize honours the request's template and its options: the same prompt
    tokens as the chat completion of the same body."""
    tokenized, chat = _both_routes(server, {"model": MODEL_NAME, "messages": MESSAGES, **changes})
    assert chat.status_code == 200, chat.text[:300]
    assert tokenized.status_code == 200, tokenized.text[:300]
    assert tokenized.json()["tokens"] == chat.json()["prompt_token_ids"]


def test_request_template_changes_the_tokens(server):
    """The request's template is used, not the model's (the same tokens would pass the test above either way)."""
    own = server.http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    theirs = server.http.post("/tokenize", json={"messages": MESSAGES, "chat_template": "{{ messages[1].content }}",
                                                 "add_special_tokens": False}).json()["tokens"]
    plain = server.http.post("/tokenize", json={"prompt": "hello there", "add_special_tokens": False}).json()
    assert theirs == plain["tokens"] != own
