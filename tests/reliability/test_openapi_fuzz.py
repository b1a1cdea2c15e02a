"""The OpenAPI document (/openapi.json, /docs) and schemathesis against it: a few hundred generated requests to
the shared server (benchmarks/fuzz_openapi.py sends 2,000 and more), then no response >= 500 except 503, no
unexpected error in the server's log (a bug answered 400 still logs one), the same engine process, /health 200,
a valid request served and every KV block free."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
from reliability_utils import MODEL_NAME, assert_server_intact, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fuzz_openapi  # noqa: E402

pytestmark = pytest.mark.slow

CI_CASES = 300
"""Generated requests in CI (~20-40 s on a loaded 2-core machine); set PAGEDLLM_FUZZ_CASES for more."""

def test_openapi_document_describes_the_request_bodies(shared_server):
    response = shared_server.http.get("/openapi.json")
    assert response.status_code == 200
    document = response.json()
    paths = document["paths"]
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        operation = paths[path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}, (path, body)
        assert "422" not in operation["responses"] and "400" in operation["responses"], path
    schemas = document["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    completion = schemas["CompletionRequest"]
    assert completion["required"] == ["prompt"]
    shapes = completion["properties"]["prompt"]["anyOf"]
    assert {"type": "string", "minLength": 1} in shapes and len(shapes) == 4
    for name in ("max_tokens", "n", "top_k", "temperature", "logit_bias", "stop", "logprobs", "cache_salt"):
        assert name in completion["properties"], name
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["items"]["required"] == ["role"]
    assert schemas["ChatCompletionRequest"]["properties"]["logprobs"]["anyOf"][0] == {"type": "boolean"}
    assert set(paths) >= {"/v1/models", "/health", "/version", "/metrics"}
    docs = shared_server.http.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_log_alarms_are_the_lines_a_bug_logs_never_a_quoted_request(shared_server):
    """A request field named like an alarm is quoted by the ignored-fields WARNING (as schemathesis once drew
    "internal error"): no alarm. An exception's ERROR line (ours, or uvicorn's) and its traceback are alarms."""
    log_start = len(shared_server.log())
    odd = {"internal error": 1, "Traceback (most recent call last):": 2, "ERROR": 3}
    response = shared_server.http.post("/v1/completions",
                                       json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1, **odd})
    assert response.status_code == 200, response.text[:300]
    assert wait_for(lambda: "internal error" in shared_server.log()[log_start:], 30.0)
    assert fuzz_openapi.log_alarms(shared_server.log()[log_start:]) == []
    bug = ("ERROR 12-03 11:33:05 [pagedllm.entrypoints.openai.errors] internal error 7: KeyError: 'x'\n"
           "Traceback (most recent call last):\n  File \"app.py\", line 1\n"
           "ERROR:    Exception in ASGI application\n")
    assert fuzz_openapi.log_alarms(bug) == [bug.splitlines()[i] for i in (0, 1, 3)]


def test_schemathesis_finds_no_server_error(shared_server):
    server = shared_server
    engine_pid = server.engine_pid()
    log_start = len(server.log())
    seed = int(os.environ.get("PAGEDLLM_FUZZ_SEED", random.randrange(1 << 32)))
    num_cases = int(os.environ.get("PAGEDLLM_FUZZ_CASES", CI_CASES))
    result = fuzz_openapi.fuzz(server.url, num_cases, seed=seed)
    print(f"FIGURE schemathesis (seed {seed}, PAGEDLLM_FUZZ_SEED repeats it): {result.summary()}")
    assert not result.failures, "\n".join(result.failures)
    assert result.num_cases >= num_cases - 2  # rounding of the shares
    statuses = result.by_status()
    assert statuses.get(200, 0) >= num_cases // 10 and statuses.get(400, 0) >= num_cases // 10, statuses
    assert server.proc.poll() is None
    log = server.log()[log_start:]
    alarms = fuzz_openapi.log_alarms(log)
    assert not alarms, "\n".join(alarms[:20])
    assert_server_intact(server, engine_pid)
