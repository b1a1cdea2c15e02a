"""Faults in the API server's output path (issue 32, item 8).

An error while handling one request's output fails that request alone: a 500 (a stream: an error event), a
logged traceback, vllm:request_success{finished_reason="error"}, and the other streams go on to their end.
Before, the error was swallowed half way through the step and raised again at every later step, so every request
on the server hung or dropped while /health said 200. Shown with an error injected into the detokenizer
(PAGEDLLM_FAULT_INJECT=raise_in_detokenizer). If the output loop itself fails (raise_in_output_loop), the server
is dead: open requests fail, /health answers 503 and the process exits non-zero, to be restarted.

A model whose vocab_size is padded past its tokenizer sampling a padded id (logit_bias) made the detokenizer raise
(that request alone failed); it now decodes to "" as in vLLM, and the request succeeds."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from reliability_utils import MODEL_NAME, Server, stream_to_its_end, unavailable, wait_for

pytestmark = pytest.mark.slow

FAULTY_SEED = 4242
TOKENIZER_SIZE, PADDED_VOCAB_SIZE = 384, 512  # tests/conftest.py's tiny_llama_padded_dir
PADDED_ID = 500
NUM_NEIGHBOURS = 3


@pytest.fixture(scope="module")
def servers(launcher, tiny_llama_padded_dir, tmp_path_factory) -> dict:
    """Every server of the module, launched at once (their start-ups overlap); each test waits for its own."""
    padded = Server(tiny_llama_padded_dir, tmp_path_factory.mktemp("padded") / "server.log", wait_ready=False)
    yield {
        "detokenizer": launcher(env={"PAGEDLLM_FAULT_INJECT": f"raise_in_detokenizer:seed={FAULTY_SEED},"
                                                              "after_tokens=3"}, wait_ready=False),
        "loop": launcher("--engine-death-exit-delay", "1",
                         env={"PAGEDLLM_FAULT_INJECT": "raise_in_output_loop:after_steps=5"}, wait_ready=False),
        "padded": padded,
    }
    padded.close()


def _sse_events(server: Server, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    return events


def _assert_internal_error(error: dict) -> None:
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == "internal_error" and "error id" in error["message"], error


def _failing_requests_fail_alone(server: Server, bad: dict, good: dict | None = None) -> None:
    """`bad` (a completion body) fails, not streaming and streaming, while NUM_NEIGHBOURS long streams (with the
    fields in `good`) run to their end; then the server is whole."""
    results: list = []
    lock = threading.Lock()
    neighbours = [threading.Thread(target=stream_to_its_end, args=(server, results, lock, 200, good))
                  for _ in range(NUM_NEIGHBOURS)]
    for thread in neighbours:
        thread.start()
    assert wait_for(lambda: server.kv()["num_open_requests"] >= NUM_NEIGHBOURS, 60)

    response = server.http.post("/v1/completions", json={**bad, "stream": False}, timeout=60)
    assert response.status_code == 500, response.text[:300]
    _assert_internal_error(response.json()["error"])
    events = _sse_events(server, bad)
    assert "error" in events[-1], events[-3:]
    _assert_internal_error(events[-1]["error"])

    for thread in neighbours:
        thread.join(timeout=120)
    assert results == [(["length"], True)] * NUM_NEIGHBOURS  # every neighbour streamed to its end and [DONE]

    assert server.http.get("/health").status_code == 200
    response = server.http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4,
                                                          **(good or {})})
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    failed = [v for k, v in server.metrics().items()
              if k.startswith("vllm:request_success_total") and 'finished_reason="error"' in k]
    assert failed == [2.0], failed
    log = server.log()
    assert log.count("could not be processed; the request fails") == 2 and "Traceback" in log


def test_an_error_in_one_requests_detokenizer_fails_that_request_alone(servers):
    server = servers["detokenizer"].wait_ready()
    _failing_requests_fail_alone(server, {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 16,
                                          "seed": FAULTY_SEED})
    assert "injected fault in the detokenizer" in server.log()


def test_a_padded_vocab_id_decodes_to_nothing_and_fails_nothing(servers):
    """An id past the tokenizer (forced by logit_bias) is "" in the text and in the logprobs, not streaming and
    streaming, completions and chat, as vLLM decodes it; the streams beside it go on to their end."""
    server = servers["padded"].wait_ready()
    # the random model samples padded ids of its own: the neighbours are kept off them
    in_vocab = {"logit_bias": {str(i): -100 for i in range(TOKENIZER_SIZE, PADDED_VOCAB_SIZE)}}
    results: list = []
    lock = threading.Lock()
    neighbours = [threading.Thread(target=stream_to_its_end, args=(server, results, lock, 200, in_vocab))
                  for _ in range(NUM_NEIGHBOURS)]
    for thread in neighbours:
        thread.start()
    assert wait_for(lambda: server.kv()["num_open_requests"] >= NUM_NEIGHBOURS, 60)

    forced = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 4, "logprobs": 2,
              "logit_bias": {str(PADDED_ID): 100}, "return_token_ids": True}
    response = server.http.post("/v1/completions", json=forced, timeout=60)
    assert response.status_code == 200, response.text[:300]
    choice = response.json()["choices"][0]
    assert choice["token_ids"] == [PADDED_ID] * 4 and choice["text"] == "" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [""] * 4
    # the top 2 raw logprobs (before the bias: vLLM's default --logprobs-mode) and the sampled padded id beside them
    assert all("" in top and len(top) in (2, 3) for top in choice["logprobs"]["top_logprobs"])

    events = _sse_events(server, forced)
    assert not [e for e in events if "error" in e], events[-3:]
    choices = [c for e in events for c in e["choices"]]
    assert "".join(c["text"] for c in choices) == "" and [c["finish_reason"] for c in choices][-1] == "length"
    assert [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]] == [""] * 4

    # a padded id in a prompt of token ids (vLLM accepts ids below the model's vocab_size), echoed
    prompt = server.http.post("/tokenize", json={"model": MODEL_NAME, "prompt": "The fox"}).json()["tokens"]
    echo = server.http.post("/v1/completions", json={**in_vocab, "model": MODEL_NAME, "echo": True, "max_tokens": 2,
                                                      "prompt": prompt[:1] + [PADDED_ID] + prompt[1:]}, timeout=60)
    assert echo.status_code == 200 and echo.json()["choices"][0]["text"].startswith("The fox"), echo.text[:300]

    chat = server.http.post("/v1/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
        "top_logprobs": 2, "logit_bias": {str(PADDED_ID): 100}})
    assert chat.status_code == 200, chat.text[:300]
    message = chat.json()["choices"][0]
    assert message["message"]["content"] == ""
    assert [(t["token"], t["bytes"]) for t in message["logprobs"]["content"]] == [("", [])] * 3

    for thread in neighbours:
        thread.join(timeout=120)
    assert results == [(["length"], True)] * NUM_NEIGHBOURS
    assert not [v for k, v in server.metrics().items()
                if k.startswith("vllm:request_success_total") and 'finished_reason="error"' in k and v]
    assert "Traceback" not in server.log()


def test_a_dead_output_loop_fails_the_server(servers):
    server = servers["loop"].wait_ready()
    events = _sse_events(server, {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 50,
                                  "ignore_eos": True})
    assert events[-1]["error"]["code"] == "engine_dead", events[-1]
    assert wait_for(lambda: unavailable(server), 30)
    assert server.proc.wait(timeout=60) != 0  # a hang guard: it exits after --engine-death-exit-delay
    log = server.log()
    assert "the output loop failed" in log and "injected fault in the output loop" in log
