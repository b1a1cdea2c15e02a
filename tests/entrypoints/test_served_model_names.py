"""`--served-model-name a b`: several names, as vLLM takes them (it took `b` as the model path). /v1/models lists
every name, a request may send any of them, and the first is the name in responses and in the metrics'
model_name label."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.config import ModelConfig
from pagedllm.entrypoints.cli.serve import add_parser, configs_from_args


def _configs(*argv: str):
    parser = argparse.ArgumentParser(prog="pagedllm")
    return configs_from_args(add_parser(parser.add_subparsers()).parse_args(list(argv)))


def test_flag_takes_several_names():
    engine, _ = _configs("some/model", "--served-model-name", "a", "b")
    assert engine.model_config.model == "some/model" and engine.model_config.served_model_name == ["a", "b"]
    engine, _ = _configs("--served-model-name", "a", "b")  # the names do not spill into the positional MODEL
    assert engine.model_config.model is None and engine.model_config.served_model_name == ["a", "b"]
    engine, _ = _configs("--served-model-name", "a", "--port", "9000", "some/model")
    assert engine.model_config.model == "some/model" and engine.model_config.served_model_name == ["a"]
    assert _configs()[0].model_config.served_model_name is None


def test_one_name_as_a_string_is_a_list_of_one():
    assert ModelConfig(served_model_name="x").served_model_name == ["x"]  # LLM(served_model_name="x")
    with pytest.raises(ValueError, match="served-model-name"):
        ModelConfig(served_model_name=[])


@pytest.mark.slow
def test_server_answers_to_every_name(remote_server_factory):
    server = remote_server_factory("--served-model-name", "first", "second", "--max-num-seqs", "4")
    models = server.get("/v1/models").json()["data"]
    assert [card["id"] for card in models] == ["first", "second"]
    client = server.client()
    for name in ("first", "second"):
        completion = client.completions.create(model=name, prompt="Hello", max_tokens=2)
        assert completion.model == "first" and completion.usage.completion_tokens == 2
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=2)
        assert chat.model == "first"
        assert server.post("/tokenize", json={"model": name, "prompt": "Hello"}).status_code == 200
    unknown = server.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 2})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    metrics = server.get("/metrics").text
    assert 'model_name="first"' in metrics and 'model_name="second"' not in metrics
