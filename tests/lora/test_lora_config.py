"""LoRA's flags: --lora-modules in both of vLLM's forms, --max-cpu-loras against --max-loras, LoRA refused with
tensor or pipeline parallelism, and vLLM's runtime-update switch."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.config import EngineConfig, LoRAConfig, ServerConfig, add_engine_flags, engine_kwargs_from_args
from pagedllm.config.lora import LoRAModulePath, parse_lora_modules
from pagedllm.entrypoints.openai.serving_models import runtime_lora_updating


def test_lora_modules_both_forms():
    modules = parse_lora_modules(["sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "m"}', ""])
    assert modules == [LoRAModulePath("sql", "/a/sql"), LoRAModulePath("chat", "/a/chat", "m")]
    for bad, message in (("{not json", "Invalid JSON format for --lora-modules"),
                         ('{"name": "x"}', "Invalid fields for --lora-modules"),
                         ('{"name": "x", "path": "/p", "rank": 8}', "Invalid fields for --lora-modules")):
        with pytest.raises(ValueError, match=message):
            ServerConfig(lora_modules=[bad])


def test_engine_flags():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--enable-lora", "--max-loras", "4", "--max-lora-rank", "32", "--lora-dtype",
                              "bfloat16"])
    lc = EngineConfig.from_kwargs(**engine_kwargs_from_args(args)).lora_config
    assert (lc.enable_lora, lc.max_loras, lc.max_lora_rank, lc.max_cpu_loras, lc.lora_dtype) == (
        True, 4, 32, 4, "bfloat16")
    with pytest.raises(ValueError, match=r"--max-cpu-loras \(2\) must be >= --max-loras \(4\)"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="--enable-lora is not supported with --tensor-parallel-size"):
        EngineConfig.from_kwargs(enable_lora=True, tensor_parallel_size=2)


@pytest.mark.parametrize(("value", "on"), [(None, False), ("0", False), ("1", True), ("True", True), ("no", False)])
def test_runtime_updating_switch(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
    assert runtime_lora_updating() is on


def test_runtime_updating_is_refused_with_several_api_servers(monkeypatch):
    from pagedllm.config import configs_from_args
    from pagedllm.entrypoints.cli.serve import add_parser

    parser = add_parser(argparse.ArgumentParser(prog="pagedllm").add_subparsers())
    args = parser.parse_args(["m", "--enable-lora", "--api-server-count", "2"])
    configs_from_args(args)  # without the runtime switch: fine
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    with pytest.raises(ValueError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING .* --api-server-count"):
        configs_from_args(args)
