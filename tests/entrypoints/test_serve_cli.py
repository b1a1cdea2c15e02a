"""`pagedllm serve` flags: vLLM's names, documented from the config docstrings, parsed into the configs."""

from __future__ import annotations

import argparse
import re

import pytest

from pagedllm.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig, field_docs, parse_bytes
from pagedllm.entrypoints.cli.serve import add_parser, configs_from_args

ISSUE_FLAGS = ["--host", "--port", "--served-model-name", "--api-key", "--max-model-len", "--max-num-seqs",
               "--max-num-batched-tokens", "--block-size", "--enable-prefix-caching", "--no-enable-prefix-caching",
               "--enable-chunked-prefill", "--scheduling-policy", "--max-num-queued-reqs", "--kv-cache-memory",
               "--dtype", "--seed", "--generation-config", "--disable-log-requests", "--uvicorn-log-level"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm")
    return add_parser(parser.add_subparsers())


def test_help_documents_every_flag_from_the_docstrings():
    text = " ".join(_parser().format_help().split())
    for flag in ISSUE_FLAGS:
        assert flag in text, flag
    for cls in (ModelConfig, CacheConfig, SchedulerConfig):
        for name, doc in field_docs(cls).items():
            if name not in ("model", "max_model_len") or cls is ModelConfig:
                assert " ".join(doc.split())[:40] in text, name


def test_flags_parse_into_configs(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    args = _parser().parse_args(["some/model", "--max-num-seqs", "4", "--no-enable-prefix-caching",
                                 "--kv-cache-memory", "2GiB", "--scheduling-policy", "priority",
                                 "--max-model-len", "1024", "--port", "9000", "--api-key", "k"])
    engine, server = configs_from_args(args)
    assert engine.model_config.model == "some/model" and engine.model_config.max_model_len == 1024
    assert engine.scheduler_config.max_num_seqs == 4 and engine.scheduler_config.scheduling_policy == "priority"
    assert engine.cache_config.enable_prefix_caching is False and engine.cache_config.kv_cache_memory == 2 << 30
    assert server.port == 9000 and server.api_key == "k"
    default_engine, default_server = configs_from_args(_parser().parse_args([]))
    assert default_engine.model_config.model is None and default_server.api_key is None
    with pytest.raises(ValueError, match="block-size"):
        configs_from_args(_parser().parse_args(["--block-size", "3"]))
    with pytest.raises(SystemExit):
        _parser().parse_args(["--scheduling-policy", "lifo"])


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert configs_from_args(_parser().parse_args([]))[1].api_key == "from-env"


def test_parse_bytes():
    assert parse_bytes("4GiB") == 4 << 30 and parse_bytes("512M") == 512_000_000 and parse_bytes("1024") == 1024
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("lots")


def test_help_lists_each_flag_once():
    """Each flag appears in the usage line and in its own entry, and nowhere else (before:
    --gpu-memory-utilization also appeared in --kv-cache-memory's help, right above its own entry, so `--help`
    seemed to list it twice)."""
    text = _parser().format_help()
    usage, _, options = text.partition("\n\n")
    flags = {word.strip("[]|,") for word in usage.split() if word.strip("[]|,").startswith("--")}
    assert "--gpu-memory-utilization" in flags and "--api-key" in flags
    for flag in flags:
        entries = [line for line in options.splitlines()  # an entry starts at column 2; its help is indented more
                   if line.startswith("  --") and flag in re.findall(r"--[\w-]+", line.strip().split("  ")[0])]
        assert len(entries) == 1, flag
    assert text.count("--gpu-memory-utilization") == 2


@pytest.mark.parametrize("flags, message", [
    (["--cache-salt-from-api-key"], "--cache-salt-from-api-key needs --api-key"),
    (["--api-key", "k1,,k2"], "--api-key contains a blank key"),
    (["--max-n", "0"], "--max-n must be at least 1"),
    (["--body-read-timeout", "0"], "--body-read-timeout must be positive"),
])
def test_invalid_server_flags_are_refused_at_startup(monkeypatch, flags, message):
    """The server configuration is checked when it is built, before anything starts (before: with
    --cache-salt-from-api-key and no key, every completion answered 500 with KeyError 'pagedllm.api_key')."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(ValueError, match=message):
        configs_from_args(_parser().parse_args(flags))


def test_server_config_validates_itself():
    with pytest.raises(ValueError, match="--cache-salt-from-api-key needs --api-key"):
        ServerConfig(cache_salt_from_api_key=True)
    with pytest.raises(ValueError, match="--max-connections must be at least 1"):
        ServerConfig(max_connections=0)
    assert ServerConfig(api_key=" a , b", cache_salt_from_api_key=True).api_keys == ["a", "b"]
    assert ServerConfig().api_keys == []


def test_blank_key_from_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", " ")
    with pytest.raises(ValueError, match="VLLM_API_KEY contains a blank key"):
        configs_from_args(_parser().parse_args([]))


@pytest.mark.parametrize("flags, message", [
    (["--data-parallel-size", "0"], "--data-parallel-size must be at least 1, got 0"),
    (["--data-parallel-size", "2", "--device", "cuda"], "--data-parallel-size above 1 is not supported with "
                                                        "--device cuda"),
])
def test_data_parallel_flags_are_checked_at_startup(flags, message):
    with pytest.raises(ValueError, match=message):
        configs_from_args(_parser().parse_args(flags))
    assert configs_from_args(_parser().parse_args(["--data-parallel-size", "2"]))[0].parallel_config \
        .data_parallel_size == 2


def test_the_offline_llm_refuses_data_parallelism():
    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="data_parallel_size above 1 needs `pagedllm serve`"):
        LLMEngine(EngineConfig.from_kwargs(data_parallel_size=2))


@pytest.mark.parametrize("model_args", [["Qwen/Qwen3-8B"], ["--model", "Qwen/Qwen3-8B"]])
def test_hub_flags_parse_as_vllm_names_them(model_args):
    """A hub id as `vllm serve MODEL` or --model takes it, with --revision, --tokenizer(-revision), --download-dir
    and --override-generation-config (a JSON object, parsed once into ModelConfig)."""
    args = _parser().parse_args([*model_args, "--revision", "v2", "--tokenizer", "Qwen/Qwen3-8B",
                                 "--tokenizer-revision", "abc", "--download-dir", "/models",
                                 "--override-generation-config", '{"temperature": 0.5, "max_new_tokens": 9}'])
    mc = configs_from_args(args)[0].model_config
    assert (mc.model, mc.revision, mc.tokenizer, mc.tokenizer_revision, mc.download_dir) == (
        "Qwen/Qwen3-8B", "v2", "Qwen/Qwen3-8B", "abc", "/models")
    assert mc.override_generation_config == {"temperature": 0.5, "max_new_tokens": 9}
    assert configs_from_args(_parser().parse_args([]))[0].model_config.override_generation_config is None


@pytest.mark.parametrize(("value", "message"), [
    ("{temperature: 1}", "not valid JSON"), ("[1]", "must be a JSON object"),
    ('{"top_k": 2.5}', "top_k must be an integer"), ('{"temperature": "hot"}', "temperature must be a number")])
def test_a_bad_override_generation_config_is_refused_at_startup(value, message):
    with pytest.raises(ValueError, match=f"--override-generation-config.*{message}"):
        configs_from_args(_parser().parse_args(["--override-generation-config", value]))
