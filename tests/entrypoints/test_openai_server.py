"""One real `pagedllm serve` process (tiny random Llama, --api-key) driven by the official openai client."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest
from server_utils import MODEL_NAME, TINY_API_KEY

pytestmark = pytest.mark.slow

API_KEY = TINY_API_KEY
PROMPT = "The quick brown fox jumps over the lazy dog"
LONG_PROMPT = " ".join(["paged attention keeps the cache in blocks"] * 8)
MESSAGES = [{"role": "user", "content": "Say something about foxes."}]


@pytest.fixture(scope="module")
def server(tiny_api_server):
    """--api-key API_KEY, --max-num-seqs 8, --enable-prompt-tokens-details (shared with the structured-output
    tests, which add only --structured-outputs-config)."""
    return tiny_api_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client(api_key=API_KEY)


@pytest.fixture
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def greedy(**kwargs):
    return {"model": MODEL_NAME, "temperature": 0.0, **kwargs}


# ---- completions -----------------------------------------------------------------------------------------


def test_completion_matches_offline_llm(client, tiny_llama_dir):
    from pagedllm import LLM, SamplingParams

    response = client.completions.create(**greedy(prompt=PROMPT, max_tokens=12),
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = response.choices[0]
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    assert response.model == MODEL_NAME and choice.finish_reason == "length"
    assert response.usage.completion_tokens == 12

    llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=16 << 20)
    expected = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)[0]
    assert choice.model_extra["token_ids"] == expected.outputs[0].token_ids
    assert choice.text == expected.outputs[0].text
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_completion_stream_equals_non_stream(client):
    full = client.completions.create(**greedy(prompt=PROMPT, max_tokens=10))
    chunks = list(client.completions.create(**greedy(prompt=PROMPT, max_tokens=10), stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_prompt_forms(client, server, auth):
    token_ids = server.post("/tokenize", json={"prompt": PROMPT}, headers=auth).json()["tokens"]
    by_text = client.completions.create(**greedy(prompt=PROMPT, max_tokens=5))
    by_ids = client.completions.create(**greedy(prompt=token_ids, max_tokens=5))
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(**greedy(prompt=[PROMPT, "hello"], max_tokens=5))
    assert [c.index for c in many.choices] == [0, 1] and many.choices[0].text == by_text.choices[0].text
    many_ids = client.completions.create(**greedy(prompt=[token_ids, token_ids], max_tokens=5, n=2))
    assert sorted(c.index for c in many_ids.choices) == [0, 1, 2, 3]
    assert all(c.text == by_text.choices[0].text for c in many_ids.choices)


def test_echo_and_logprobs(client):
    prompt = "A prompt seen only once, so none of it is in the prefix cache"
    response = client.completions.create(**greedy(prompt=prompt, max_tokens=4, logprobs=3, echo=True))
    choice = response.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    num_tokens = response.usage.prompt_tokens + response.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == num_tokens
    assert lp.token_logprobs[0] is None  # the first prompt token has no logprob
    assert all(v is not None for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
    generated = lp.top_logprobs[-4:]
    assert all(1 <= len(top) <= 4 for top in generated)
    # greedy: the chosen token is the most likely one
    assert all(lp.token_logprobs[-4 + i] == pytest.approx(max(top.values())) for i, top in enumerate(generated))
    assert all(lp.token_logprobs[-4 + i] == top[lp.tokens[-4 + i]] for i, top in enumerate(generated))


def test_stop_string(client):
    text = client.completions.create(**greedy(prompt=PROMPT, max_tokens=16),
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = text[4:7]
    assert len(stop) == 3 and stop.strip()
    response = client.completions.create(**greedy(prompt=PROMPT, max_tokens=16, stop=[stop]),
                                         extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    assert choice.text == text[:text.index(stop)]
    streamed = client.completions.create(**greedy(prompt=PROMPT, max_tokens=16, stop=[stop], stream=True),
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_n2_with_seed(client):
    kwargs = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "n": 2, "seed": 7, "temperature": 1.0}
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens <= 16
    indices = {c.choices[0].index for c in client.completions.create(**kwargs, stream=True) if c.choices}
    assert indices == {0, 1}


def test_cached_tokens_on_repeated_prompt(client):
    first = client.completions.create(**greedy(prompt=LONG_PROMPT, max_tokens=2))
    second = client.completions.create(**greedy(prompt=LONG_PROMPT, max_tokens=2))
    assert first.usage.prompt_tokens >= 33
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert second.usage.prompt_tokens_details.cached_tokens % 16 == 0


# ---- chat -------------------------------------------------------------------------------------------------


def test_chat_matches_offline_template(client, server, auth):
    response = client.chat.completions.create(**greedy(messages=MESSAGES, max_completion_tokens=8))
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    message = response.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    tokenized = server.post("/tokenize", json={"messages": MESSAGES}, headers=auth).json()
    assert response.usage.prompt_tokens == tokenized["count"]
    chunks = list(client.chat.completions.create(**greedy(messages=MESSAGES, max_tokens=8), stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    assert chunks[-1].usage.completion_tokens == response.usage.completion_tokens


def test_chat_logprobs_and_continue_final_message(client):
    response = client.chat.completions.create(**greedy(messages=MESSAGES, max_tokens=5, logprobs=True,
                                                       top_logprobs=2))
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob)
               for t in content)
    cont = client.chat.completions.create(
        **greedy(messages=[*MESSAGES, {"role": "assistant", "content": "Foxes are"}], max_tokens=4),
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert cont.choices[0].finish_reason in ("length", "stop")


# ---- other routes ------------------------------------------------------------------------------------------


def test_models_version_tokenize_detokenize(client, server, auth):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME] and models[0].model_extra["max_model_len"] == 512
    assert server.get("/version", headers=auth).json()["version"]
    tokens = server.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False},
                         headers=auth).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    text = server.post("/detokenize", json={"tokens": tokens["tokens"]}, headers=auth).json()["prompt"]
    assert text == PROMPT


def test_metrics_have_vllm_names(client, server):
    client.completions.create(**greedy(prompt=PROMPT, max_tokens=3))
    text = server.get("/metrics").text  # no key needed for /metrics
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:admission_rejections_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket", "vllm:request_prefill_time_seconds_bucket",
                 "vllm:request_decode_time_seconds_bucket", "vllm:request_prompt_tokens_bucket",
                 "vllm:request_generation_tokens_bucket", "vllm:iteration_tokens_total_bucket"):
        assert f'{name}{{' in text, name
    assert f'model_name="{MODEL_NAME}"' in text
    assert server.metric("vllm:generation_tokens_total") >= 3
    assert 'vllm:request_success_total{finished_reason="length"' in text
    # the pool's capacity, as vLLM labels it (num_gpu_blocks * block_size tokens)
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert 'block_size="16"' in info and 'cache_dtype="auto"' in info and info.endswith("} 1.0")
    assert int(info.split('num_gpu_blocks="')[1].split('"')[0]) == server.metric("pagedllm:kv_cache_total_blocks")


# ---- errors ------------------------------------------------------------------------------------------------


def _assert_error_body(body: dict, status_type: str = "invalid_request_error") -> dict:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == status_type
    return error


def _next_request_succeeds(client):
    after = client.completions.create(**greedy(prompt=PROMPT, max_tokens=2, extra_body={"ignore_eos": True}))
    assert after.usage.completion_tokens == 2 and after.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": "many"}, "max_tokens"),  # pydantic validation: 422 turned into 400
    ({"temperature": 5.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"n": 0}, "n"),
    ({"logprobs": 50}, "logprobs"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"max_tokens": 10**6}, "max_tokens"),
])
def test_bad_parameters_are_400(client, server, auth, body, param):
    response = server.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, **body}, headers=auth)
    assert response.status_code == 400, response.text
    assert _assert_error_body(response.json())["param"] == param
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, extra_body=body)
    _next_request_succeeds(client)


def test_prompt_too_long_is_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=[10 + i % 300 for i in range(600)], max_tokens=4)
    assert info.value.status_code == 400
    error = info.value.body
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x " * 700}])
    assert info.value.body["code"] == "context_length_exceeded"
    _next_request_succeeds(client)


def test_malformed_json_and_unknown_fields(client, server, auth):
    response = server.post("/v1/chat/completions", content=b"{not json", headers=auth)
    assert response.status_code == 400
    _assert_error_body(response.json())
    response = server.post("/v1/chat/completions", json={"model": MODEL_NAME}, headers=auth)
    assert response.status_code == 400 and _assert_error_body(response.json())["param"] == "messages"
    ok = client.completions.create(**greedy(prompt=PROMPT, max_tokens=2),
                                   extra_body={"no_such_field": 1, "top_k": 5, "min_p": 0.1,
                                               "repetition_penalty": 1.1, "min_tokens": 1, "priority": 0,
                                               "cache_salt": "salt", "skip_special_tokens": False,
                                               "include_stop_str_in_output": True})
    assert ok.choices[0].finish_reason == "length"
    custom = client.completions.create(**greedy(prompt=PROMPT, max_tokens=2), extra_body={"request_id": "abc"})
    assert custom.id == "cmpl-abc"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert info.value.status_code == 404 and info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    _next_request_succeeds(client)


def test_embeddings_are_a_404_on_a_generate_server(client):
    """vLLM registers /v1/embeddings only on a pooling server (tests/entrypoints/test_embeddings_server.py)."""
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model=MODEL_NAME, input="Hello")


def test_api_key(server, client):
    for key in ("wrong", API_KEY + "x", ""):
        with pytest.raises(openai.AuthenticationError) as info:
            server.client(api_key=key or "k").completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
        assert info.value.status_code == 401
    for path in ("/v1/models", "/version", "/debug/kv_cache"):
        response = server.get(path)
        assert response.status_code == 401 and _assert_error_body(response.json())["code"] == "invalid_api_key"
    assert server.post("/tokenize", json={"prompt": "x"}).status_code == 401
    assert server.get("/health").status_code == 200
    assert server.get("/ping").status_code == server.post("/ping").status_code == 200  # vLLM's probe alias
    assert server.get("/metrics").status_code == 200
    _next_request_succeeds(client)


# ---- aborts ------------------------------------------------------------------------------------------------


def test_stream_disconnect_aborts(server, auth):
    aborted_before = server.metric('vllm:request_success_total{finished_reason="abort",model_name="tiny"}')
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 450, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30.0) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body, headers=auth) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            kv = server.get("/debug/kv_cache", headers=auth).json()
            assert kv["num_running_reqs"] == 1 and kv["num_free_blocks"] < kv["num_total_blocks"]
    kv = server.wait_idle()
    assert (kv["num_running_reqs"], kv["num_waiting_reqs"]) == (0, 0)
    assert kv["num_free_blocks"] == kv["num_total_blocks"]
    assert server.metric("vllm:num_requests_running") == 0 and server.metric("vllm:num_requests_waiting") == 0
    after = server.metric('vllm:request_success_total{finished_reason="abort",model_name="tiny"}')
    assert after == aborted_before + 1


def test_non_stream_disconnect_aborts(server, auth):
    """The client's socket closes while its non-streaming request runs (as soon as the engine shows it running,
    not after a fixed timeout, which a fast machine outran: 450 tokens of the tiny model in under 0.4 s)."""
    body = json.dumps({"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 450, "ignore_eos": True}).encode()
    url = httpx.URL(server.url)
    aborted_before = server.metric('vllm:request_success_total{finished_reason="abort",model_name="tiny"}')
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\nContent-Type: application/json\r\n"
               f"Authorization: {auth['Authorization']}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection((url.host, url.port), timeout=10) as sock:
        sock.sendall(request)
        deadline, running = time.monotonic() + 5.0, False
        while not running and time.monotonic() < deadline:
            running = server.get("/debug/kv_cache", headers=auth).json()["num_running_reqs"] > 0
            time.sleep(0.005)
    assert running  # the request ran in the engine before the client left
    kv = server.wait_idle()
    assert (kv["num_running_reqs"], kv["num_waiting_reqs"], kv["num_open_requests"]) == (0, 0, 0)
    assert kv["num_free_blocks"] == kv["num_total_blocks"]
    assert server.metric('vllm:request_success_total{finished_reason="abort",model_name="tiny"}') == aborted_before + 1
