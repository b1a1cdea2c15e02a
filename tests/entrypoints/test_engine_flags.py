"""vLLM's model and engine flags that pagedllm honours (issue 35 item 2): --trust-remote-code (a warning: no remote
code runs), --max-logprobs, --kv-cache-memory-bytes, --load-format, --seed, --dtype's other spellings and vLLM's
human-readable integers; first at the parser and engine level, then once through a real server."""

from __future__ import annotations

import argparse
import logging

import httpx
import pytest
from server_utils import MODEL_NAME, RemoteServer

from pagedllm.config import ModelConfig, configs_from_args
from pagedllm.engine.input_processor import InputProcessor, InvalidRequestError
from pagedllm.entrypoints.cli.serve import add_parser
from pagedllm.messages import ModelLimits
from pagedllm.models.loader import ModelLoadError, resolve_model
from pagedllm.sampling_params import SamplingParams


def _configs(*argv: str):
    parser = add_parser(argparse.ArgumentParser(prog="pagedllm").add_subparsers())
    return configs_from_args(parser.parse_args(["some/model", *argv]))


def test_trust_remote_code_warns_that_no_remote_code_runs(caplog):
    with caplog.at_level(logging.WARNING, logger="pagedllm.config"):
        engine, _ = _configs("--trust-remote-code")
    assert engine.model_config.trust_remote_code is True
    assert [r.getMessage() for r in caplog.records if "remote code" in r.getMessage()] == [
        "--trust-remote-code: pagedllm never runs code from a model repository (its model families and tokenizers "
        "are its own); no remote code runs."]
    caplog.clear()
    _configs("--no-trust-remote-code")
    assert not caplog.records


def test_kv_cache_memory_bytes_sizes_the_pool():
    assert _configs("--kv-cache-memory-bytes", "1G")[0].cache_config.kv_cache_memory == 1 << 30
    assert _configs("--kv-cache-memory-bytes", "2.5g")[0].cache_config.kv_cache_memory == 2_500_000_000
    assert _configs("--kv-cache-memory-bytes", "123456")[0].cache_config.kv_cache_memory == 123456
    assert _configs("--kv-cache-memory-bytes", "512Mi")[0].cache_config.kv_cache_memory == 512 << 20  # the help's form
    assert _configs("--kv-cache-memory", "1GiB", "--kv-cache-memory-bytes", "1G")[0].cache_config.kv_cache_memory \
        == 1 << 30
    with pytest.raises(ValueError, match="--kv-cache-memory-bytes 1073741824 and --kv-cache-memory 2147483648"):
        _configs("--kv-cache-memory", "2GiB", "--kv-cache-memory-bytes", "1G")
    with pytest.raises(SystemExit):
        _configs("--kv-cache-memory-bytes", "1.5G")  # vLLM: no decimals with binary suffixes


def test_api_key_takes_vllms_several_values(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert _configs("--api-key", "k1", "k2")[1].api_keys == ["k1", "k2"]
    assert _configs("--api-key", "k1,k2")[1].api_keys == ["k1", "k2"]


def test_vllm_spellings_of_values():
    engine, _ = _configs("--max-model-len", "32k", "--max-num-batched-tokens", "2K", "--dtype", "half", "-tp", "1",
                         "--seed", "7")
    assert engine.model_config.max_model_len == 32000 and engine.scheduler_config.max_num_batched_tokens == 2048
    assert engine.model_config.dtype == "float16" and engine.model_config.seed == 7
    assert _configs("--max-model-len", "auto")[0].model_config.max_model_len is None
    assert _configs("--dtype", "float")[0].model_config.dtype == "float32"


def test_load_format(tiny_llama_dir, tiny_llama_gguf):
    assert resolve_model(ModelConfig(model=str(tiny_llama_dir), load_format="safetensors")).kind == "hf"
    assert resolve_model(ModelConfig(model=str(tiny_llama_gguf), load_format="gguf")).kind == "gguf"
    assert resolve_model(ModelConfig(model=str(tiny_llama_gguf), load_format="auto")).kind == "gguf"
    with pytest.raises(ModelLoadError, match="--load-format safetensors: .* is a gguf model"):
        resolve_model(ModelConfig(model=str(tiny_llama_gguf), load_format="safetensors"))
    with pytest.raises(ModelLoadError, match="--load-format gguf: .* is a safetensors model"):
        resolve_model(ModelConfig(model=str(tiny_llama_dir), load_format="gguf"))
    for value in ("pt", "dummy", "npcache"):
        with pytest.raises(ValueError, match=f"--load-format '{value}' is not supported"):
            _configs("--load-format", value)


def test_max_logprobs_caps_requests():
    limits = ModelLimits(vocab_size=100, max_model_len=64, eos_token_id=None, max_logprobs=3)
    processor = InputProcessor(limits)
    processor.process("a", [1, 2], SamplingParams(logprobs=3, prompt_logprobs=3))
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequestError, match=rf"{field} must be in \[0, 3\] \(--max-logprobs\), got 4") as e:
            processor.process("a", [1, 2], SamplingParams(**{field: 4}))
        assert e.value.param == field
    unlimited = InputProcessor(ModelLimits(vocab_size=100, max_model_len=64, eos_token_id=None, max_logprobs=-1))
    unlimited.process("a", [1, 2], SamplingParams(logprobs=100))
    with pytest.raises(InvalidRequestError, match=r"logprobs must be in \[0, 100\]"):
        unlimited.process("a", [1, 2], SamplingParams(logprobs=101))
    assert _configs()[0].model_config.max_logprobs == 20  # vLLM's default


@pytest.mark.slow
def test_engine_flags_through_a_server(tiny_llama_dir):
    server = RemoteServer(tiny_llama_dir, "--max-logprobs", "3", "--trust-remote-code", "--load-format",
                          "safetensors", "--kv-cache-memory-bytes", "64M", "--seed", "7", "--enforce-eager")
    try:
        base = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
        ok = server.post("/v1/completions", json={**base, "logprobs": 3})
        tops = ok.json()["choices"][0]["logprobs"]["top_logprobs"]  # by text: tokens decoding alike share a key
        assert ok.status_code == 200 and len(tops) == 2 and all(1 <= len(t) <= 3 for t in tops)
        for body, param in (({**base, "logprobs": 4}, "logprobs"), ({**base, "prompt_logprobs": 4}, "prompt_logprobs")):
            bad = server.post("/v1/completions", json=body)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                "logprobs": True}
        assert server.post("/v1/chat/completions", json={**chat, "top_logprobs": 3}).status_code == 200
        bad = server.post("/v1/chat/completions", json={**chat, "top_logprobs": 4})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs", bad.text
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'kv_cache_memory_bytes="67108864"' in metrics  # 64M = 64 MiB, as serve_command's --kv-cache-memory
    finally:
        server.close()
