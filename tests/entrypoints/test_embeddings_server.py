"""POST /v1/embeddings on a real `pagedllm serve --runner pooling` process, with the real `openai` client.

The server runs the tiny random Llama with a config.json that declares matryoshka dimensions (and a tokenizer that
adds BOS, so that add_special_tokens shows). Checked: float and
base64 answers (the SDK asks for base64 by default and decodes little-endian float32) carry the same vectors;
input as a string, a list of strings, token ids and lists of token ids; a batch gives the vectors one input at a
time gives; `dimensions` (matryoshka: cut, then normalised; a value the model does not list is vLLM's 400); usage;
every declared field of EmbeddingRequest honoured or refused with a 400 naming it; the generation routes are a 404
on a pooling server (vLLM registers one kind); the metrics count
prompt tokens, latency and time to the vector, no generation tokens; every KV block is free at the end.
"""

from __future__ import annotations

import base64
import json
import shutil

import numpy as np
import pytest
from request_fields import declared_fields
from server_utils import MODEL_NAME, RemoteServer

from pagedllm.entrypoints.openai.embedding_protocol import EmbeddingRequest

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello world!", "Paged attention stores the KV cache."]
DIMS = [16, 32, 64]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-matryoshka") / "model"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": DIMS}))
    tokenizer = json.loads((folder / "tokenizer.json").read_text())  # BOS added, so add_special_tokens shows
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    server = RemoteServer(folder, "--runner", "pooling", "--max-num-batched-tokens", "8")
    yield server
    server.close()


def _post(server, **fields):
    return server.post("/v1/embeddings", json={"model": MODEL_NAME, "input": TEXTS[0], **fields})


def _vector(server, **fields) -> np.ndarray:
    response = _post(server, **fields)
    assert response.status_code == 200, response.text
    return np.asarray(response.json()["data"][0]["embedding"])


def test_openai_client_float_and_base64(server):
    client = server.client()
    floats = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    default = client.embeddings.create(model=MODEL_NAME, input=TEXTS)  # the SDK sends base64 and decodes it
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.model == MODEL_NAME
    for a, b in zip(floats.data, default.data, strict=True):
        assert len(a.embedding) == 64 and a.embedding == b.embedding
        assert abs(np.linalg.norm(a.embedding) - 1) < 1e-5
    num_tokens = floats.usage.prompt_tokens
    assert num_tokens == floats.usage.total_tokens == sum(len(server.post("/tokenize", json={
        "model": MODEL_NAME, "prompt": t}).json()["tokens"]) for t in TEXTS)
    # one input at a time: the batch's vectors; token ids as input: the text's
    for text, data in zip(TEXTS, floats.data, strict=True):
        assert client.embeddings.create(model=MODEL_NAME, input=text, encoding_format="float").data[0].embedding \
            == data.embedding
    ids = [server.post("/tokenize", json={"model": MODEL_NAME, "prompt": t}).json()["tokens"] for t in TEXTS[:2]]
    by_ids = client.embeddings.create(model=MODEL_NAME, input=ids, encoding_format="float")
    assert [d.embedding for d in by_ids.data] == [d.embedding for d in floats.data[:2]]
    assert client.embeddings.create(model=MODEL_NAME, input=ids[0], encoding_format="float").data[0].embedding \
        == floats.data[0].embedding
    # matryoshka: the first 16 values of the raw vector, normalised
    raw = _vector(server, use_activation=False)
    cut = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], dimensions=16, encoding_format="float")
    assert np.allclose(cut.data[0].embedding, raw[:16] / np.linalg.norm(raw[:16]), atol=1e-6)
    assert server.wait_idle()["num_free_blocks"] == server.kv_cache()["num_total_blocks"]


def test_generation_routes_are_a_404(server):
    """vLLM registers one kind of routes (/v1/embeddings on a generate server: test_openai_server.py)."""
    assert server.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi"}).status_code == 404
    assert server.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": [
        {"role": "user", "content": "Hi"}]}).status_code == 404


def test_metrics_count_prompt_tokens_not_generation(server):
    before = {m: server.metric(m) for m in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                                            "vllm:e2e_request_latency_seconds_count",
                                            "vllm:time_to_first_token_seconds_count",
                                            "vllm:request_generation_tokens_count")}
    usage = _post(server, input=TEXTS).json()["usage"]
    after = {m: server.metric(m) for m in before}
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == usage["prompt_tokens"]
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:time_to_first_token_seconds_count"):
        assert after[name] - before[name] == 3  # vLLM's TTFT of an embedding: the time to its vector
    assert after["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"]
    assert after["vllm:request_generation_tokens_count"] == before["vllm:request_generation_tokens_count"]


# ---- every declared field -----------------------------------------------------------------------------------


def _refused(param, **fields):
    def check(server):
        response = _post(server, **fields)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param, response.text
    return check


def _model(server):
    assert _post(server).status_code == 200
    response = _post(server, model="no-such-model")
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


def _input(server):
    assert len(_post(server, input=TEXTS).json()["data"]) == 3
    _refused("input", input=[])(server)
    _refused("input", input=[[1, 2], "text"])(server)


def _encoding_format(server):
    data = _post(server, encoding_format="base64").json()["data"][0]["embedding"]
    assert np.array_equal(np.frombuffer(base64.b64decode(data), dtype="<f4"), _vector(server).astype(np.float32))
    _refused("encoding_format", encoding_format="bytes")(server)


def _dimensions(server):
    assert len(_vector(server, dimensions=32)) == 32
    response = _post(server, dimensions=20)
    assert response.status_code == 400 and response.json()["error"]["param"] == "dimensions"
    assert "only supports Matryoshka dimensions [16, 32, 64], got 20" in response.json()["error"]["message"]


def _user(server):
    assert np.array_equal(_vector(server, user="someone"), _vector(server))


def _truncate_prompt_tokens(server):
    ids = server.post("/tokenize", json={"model": MODEL_NAME, "prompt": TEXTS[0]}).json()["tokens"]
    assert np.array_equal(_vector(server, truncate_prompt_tokens=3), _vector(server, input=ids[:3]))
    assert np.array_equal(_vector(server, truncate_prompt_tokens=-1), _vector(server))
    _refused("truncate_prompt_tokens", truncate_prompt_tokens=100000)(server)


def _truncation_side(server):
    ids = server.post("/tokenize", json={"model": MODEL_NAME, "prompt": TEXTS[0]}).json()["tokens"]
    assert np.array_equal(_vector(server, truncate_prompt_tokens=3, truncation_side="left"),
                          _vector(server, input=ids[-3:]))


def _request_id(server):
    assert _post(server, request_id="abc").json()["id"] == "embd-abc"


def _priority(server):
    _refused("priority", priority=5)(server)  # fcfs server: vLLM's refusal


def _cache_salt(server):
    long_text = " ".join(TEXTS * 3)
    _post(server, input=long_text)
    ids = server.post("/tokenize", json={"model": MODEL_NAME, "prompt": long_text}).json()["tokens"]
    hits = server.metric("vllm:prefix_cache_hits_total")
    assert np.array_equal(_vector(server, input=long_text, cache_salt="tenant-a"), _vector(server, input=ids))
    assert server.metric("vllm:prefix_cache_hits_total") > hits  # the unsalted run hit: LAST reads the cache
    _refused("cache_salt", cache_salt="")(server)


def _add_special_tokens(server):
    assert not np.array_equal(_vector(server, add_special_tokens=False), _vector(server))


def _embed_dtype(server):
    full = _vector(server).astype(np.float32)
    half = _post(server, encoding_format="base64", embed_dtype="float16").json()["data"][0]["embedding"]
    assert np.array_equal(np.frombuffer(base64.b64decode(half), dtype="<f2"), full.astype(np.float16))
    bf16 = _post(server, encoding_format="base64", embed_dtype="bfloat16").json()["data"][0]["embedding"]
    widened = (np.frombuffer(base64.b64decode(bf16), dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    assert np.allclose(widened, full, rtol=1e-2)
    _refused("embed_dtype", embed_dtype="fp8_e4m3")(server)


def _endianness(server):
    big = _post(server, encoding_format="base64", endianness="big").json()["data"][0]["embedding"]
    assert np.array_equal(np.frombuffer(base64.b64decode(big), dtype=">f4"), _vector(server).astype(np.float32))


def _use_activation(server):
    raw = _vector(server, use_activation=False)
    assert abs(np.linalg.norm(raw) - 1) > 1e-3 and np.allclose(_vector(server), raw / np.linalg.norm(raw),
                                                                 atol=1e-6)


FIELDS = {
    "model": _model, "input": _input, "encoding_format": _encoding_format, "dimensions": _dimensions,
    "user": _user, "truncate_prompt_tokens": _truncate_prompt_tokens, "truncation_side": _truncation_side,
    "padding": _refused("padding", padding="max_length"), "request_id": _request_id, "priority": _priority,
    "mm_processor_kwargs": _refused("mm_processor_kwargs", mm_processor_kwargs={"a": 1}),
    "cache_salt": _cache_salt, "add_special_tokens": _add_special_tokens, "embed_dtype": _embed_dtype,
    "endianness": _endianness, "use_activation": _use_activation,
}


def test_every_declared_field_is_walked(server):
    assert set(declared_fields(EmbeddingRequest)) == set(FIELDS)
    for check in FIELDS.values():
        check(server)
