"""Structured outputs through a real `pagedllm serve` (tiny random Llama) and the official openai client:
response_format, extra_body structured_outputs, `chat.completions.parse(response_format=PydanticModel)`,
streaming, and the 400s that name the field."""

from __future__ import annotations

import json
import re

import pytest
from pydantic import BaseModel, Field
from server_utils import MODEL_NAME, RemoteServer

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Describe a person."}]


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    role: str = Field(pattern="^(admin|user)$")


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    server = RemoteServer(tiny_llama_dir, "--max-num-seqs", "8", "--structured-outputs-config",
                          '{"backend": "guidance"}')
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_parse_with_a_pydantic_model(client):
    for temperature in (0.0, 1.0):
        completion = client.chat.completions.parse(
            model=MODEL_NAME, messages=MESSAGES, response_format=Person, max_tokens=80, temperature=temperature,
            extra_body={"structured_outputs": {"disable_any_whitespace": True}})
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Person)
        assert Person.model_validate_json(message.content) == message.parsed


def test_response_format_json_object_and_json_schema(client):
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=40, response_format={"type": "json_object"},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    if completion.choices[0].finish_reason == "stop":  # a random model may write a long object
        assert isinstance(json.loads(completion.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=40, temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": schema, "strict": True}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    assert json.loads(completion.choices[0].message.content) in ({"ok": True}, {"ok": False})
    text = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5,
                                          response_format={"type": "text"})
    assert text.choices[0].finish_reason in ("stop", "length")


def test_structured_outputs_on_completions_and_streaming(client):
    completion = client.completions.create(model=MODEL_NAME, prompt="Code:", max_tokens=20, temperature=1.0,
                                           extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{2}[0-9]{3}", completion.choices[0].text)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, stream=True,
                                            n=2, temperature=1.0,
                                            extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    texts, reasons = {0: "", 1: ""}, {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert all(t in ("alpha", "beta") for t in texts.values()) and reasons == {0: "stop", 1: "stop"}


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": {"type": "frob"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": "string", "format": "no-such"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
])
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    response = server.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES,
                                                         "max_tokens": 5, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_unknown_fields_are_ignored(server):
    response = server.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2,
                                                    "guided_json": {"type": "object"}})
    assert response.status_code == 200, response.text


def test_a_bad_backend_is_a_startup_error(tiny_llama_dir):
    server = RemoteServer(tiny_llama_dir, "--structured-outputs-config", '{"backend": "xgrammar"}', wait_ready=False)
    try:
        assert server.proc.wait(timeout=60) != 0
    finally:
        server.close()
