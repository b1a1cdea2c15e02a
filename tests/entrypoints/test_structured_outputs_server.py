"""Structured outputs through a real `pagedllm serve` (tiny random Llama) and the official openai client:
response_format, extra_body structured_outputs, `chat.completions.parse(response_format=PydanticModel)`,
streaming, and the 400s that name the field."""

from __future__ import annotations

import json
import re
import time

import pytest
from pydantic import BaseModel, Field
from server_utils import MODEL_NAME, TINY_API_KEY, RemoteServer

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Describe a person."}]


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    role: str = Field(pattern="^(admin|user)$")


@pytest.fixture(scope="module")
def server(tiny_api_server):
    """--structured-outputs-config '{"backend": "guidance"}' and --max-num-seqs 8, on the server shared with the
    OpenAI API tests (so behind an API key: `server.headers`)."""
    return tiny_api_server


@pytest.fixture(scope="module")
def client(server):
    return server.client(api_key=TINY_API_KEY)


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
    response = server.post("/v1/chat/completions", headers=server.headers,
                           json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 5, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_unknown_fields_are_ignored(server):
    response = server.post("/v1/completions", headers=server.headers,
                           json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2,
                                 "guided_json": {"type": "object"}})
    assert response.status_code == 200, response.text


def test_a_bad_backend_is_a_startup_error(tiny_llama_dir):
    server = RemoteServer(tiny_llama_dir, "--structured-outputs-config", '{"backend": "xgrammar"}', wait_ready=False)
    try:
        assert server.proc.wait(timeout=60) != 0
    finally:
        server.close()


def _ref_chain(n: int) -> dict:
    """$defs d0 -> d1 -> ... -> dn, each an object whose one property refers to the next."""
    defs = {f"d{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["next"]}
            for i in range(n)}
    return {"$defs": {**defs, f"d{n}": {"type": "string"}}, "$ref": "#/$defs/d0"}


def test_the_bodies_that_crashed_the_server_are_400s_naming_the_limit(server):
    """A 1,000-deep $ref chain (as a response_format, as a required tool's parameters) and 3,000 chained Lark
    rules overflowed llguidance's native stack and killed the server; each is now a 400 naming the field and the
    limit, and the same server (and engine) answers next."""
    engine = server.child_pids()  # the engine core, and grammar children started by earlier tests
    rules = "start: r0\n" + "\n".join(f'r{i}: "t" r{i + 1}' for i in range(3000)) + '\nr3000: "t"\n'
    tool = {"type": "function", "function": {"name": "deep", "parameters": _ref_chain(1000)}}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": _ref_chain(1000)}}},
         "response_format", "$ref chain depth"),
        ({"tools": [tool], "tool_choice": "required"}, "tools[0].function.parameters", "$ref chain depth"),
        ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "deep"}}},
         "tools[0].function.parameters", "$ref chain depth"),
        ({"structured_outputs": {"grammar": rules}}, "structured_outputs.grammar", "rule-reference depth"),
    ]
    for body, param, limit in cases:
        response = server.post("/v1/chat/completions", headers=server.headers,
                               json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 5, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["type"]) == (param, "invalid_request_error"), error
        assert limit in error["message"] and "limit of" in error["message"], error
    assert server.proc.poll() is None and set(engine) <= set(server.child_pids())  # none died, none restarted
    response = server.post("/v1/chat/completions", headers=server.headers,
                           json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 5,
                                 "structured_outputs": {"choice": ["yes", "no"]}})
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] in ("yes", "no")


def test_big_choices_never_starve_small_ones(server):
    """Six concurrent 100,000-entry choices (a thread each kept compiling after its timeout, and every other
    client's two-entry choice timed out) are refused by size at once; big choices under the bound compile apart
    (the big lane), while small ones from other clients all succeed."""
    import concurrent.futures

    def post(choices: list[str]) -> tuple[int, dict]:
        response = server.post("/v1/chat/completions", headers=server.headers, timeout=120.0, json={
            "model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, "structured_outputs": {"choice": choices}})
        return response.status_code, response.json()

    huge = [f"option number {i}" for i in range(100_000)]
    big = [f"choice number {i}" for i in range(15_000)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        huge_results = [pool.submit(post, huge) for _ in range(6)]
        big_results = [pool.submit(post, big) for _ in range(2)]
        time.sleep(3.0)  # the big ones arrive first (before the fix they then held every validation thread)
        small_results = [pool.submit(post, ["yes", "no"]) for _ in range(6)]
        for future in small_results:
            status, body = future.result()
            assert status == 200, body
            assert body["choices"][0]["message"]["content"] in ("yes", "no")
        for future in huge_results:
            status, body = future.result()
            assert status == 400 and body["error"]["param"] == "structured_outputs.choice", body
            assert "number of choice entries is 100,000" in body["error"]["message"]
        for future in big_results:
            status, body = future.result()  # compiled, or (on a loaded machine) refused for its own compile time
            assert status == 200 or "longer than" in body["error"]["message"], body
