"""`pagedllm serve --config FILE` reads flags from YAML as vLLM's FlexibleArgumentParser does (keys are flag names
with - or _, the command line wins, nested objects are JSON flags), `--flag_name` is `--flag-name`, and vLLM's
environment equivalents of server flags hold where the flag is not given."""

from __future__ import annotations

import argparse
import logging

import pytest

from pagedllm.config import configs_from_args
from pagedllm.entrypoints.cli.serve import add_parser, preprocess_argv


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = add_parser(argparse.ArgumentParser(prog="pagedllm").add_subparsers())
    return parser.parse_args(preprocess_argv(["serve", *argv], parser)[1:])


def test_file_flags_and_command_line_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    config = tmp_path / "serve.yaml"
    config.write_text("model: from/file\nport: 8001\nmax_num_seqs: 8\nenable-prefix-caching: false\n"
                      "served-model-name: [a, b]\nspeculative-config:\n  method: ngram\n  num_speculative_tokens: 3\n"
                      "max-model-len: 4k\n")
    engine, server = configs_from_args(_parse(["--config", str(config), "--port", "9001"]))
    assert engine.model_config.model == "from/file" and server.port == 9001  # the command line wins
    assert engine.scheduler_config.max_num_seqs == 8 and engine.cache_config.enable_prefix_caching is False
    assert engine.model_config.served_model_name == ["a", "b"] and engine.model_config.max_model_len == 4000
    assert engine.speculative_config.method == "ngram" and engine.speculative_config.num_speculative_tokens == 3
    engine, _ = configs_from_args(_parse(["cli/model", f"--config={config}", "--max_num_seqs", "2"]))
    assert engine.model_config.model == "cli/model" and engine.scheduler_config.max_num_seqs == 2
    for spelling in (["-O3"], ["-O=3"], ["-O", "3"]):  # vLLM's -O: --optimization-level (accepted, no effect)
        assert _parse(["m", *spelling]).vllm_only_optimization_level == "3"


def test_unknown_key_is_refused_naming_it(tmp_path, capsys):
    config = tmp_path / "serve.yml"
    config.write_text("port: 8001\nmax-num-sequences: 8\n")
    with pytest.raises(SystemExit) as e:
        _parse(["m", "--config", str(config)])
    assert e.value.code == 2
    assert "unknown key 'max-num-sequences'" in capsys.readouterr().err
    (tmp_path / "serve.json").write_text("{}")
    with pytest.raises(SystemExit):
        _parse(["m", "--config", str(tmp_path / "serve.json")])
    assert "must be YAML" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse(["m", "--config", str(tmp_path / "missing.yaml")])
    assert "cannot read it" in capsys.readouterr().err


def test_vllm_only_flags_from_the_file_keep_their_class(tmp_path, caplog):
    config = tmp_path / "serve.yaml"
    config.write_text("enforce-eager: true\ncudagraph-capture-sizes: [1, 2, 4]\n")
    with caplog.at_level(logging.INFO, logger="pagedllm.config"):
        configs_from_args(_parse(["m", "--config", str(config)]))
    assert sum("no effect" in r.getMessage() for r in caplog.records) == 2
    config.write_text("grpc: true\n")
    with pytest.raises(ValueError, match="--grpc is not supported by pagedllm"):
        configs_from_args(_parse(["m", "--config", str(config)]))


def test_vllm_environment_equivalents(monkeypatch):
    monkeypatch.setenv("VLLM_ENGINE_READY_TIMEOUT_S", "42")
    _, server = configs_from_args(_parse(["m"]))
    assert server.engine_startup_timeout == 42.0
    _, server = configs_from_args(_parse(["m", "--engine-startup-timeout", "7"]))
    assert server.engine_startup_timeout == 7.0  # the flag wins


def test_logging_environment(monkeypatch, caplog):
    from pagedllm.entrypoints.cli.main import main

    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "loud")
    with caplog.at_level(logging.ERROR):
        assert main(["serve", "m"]) == 2
    assert "VLLM_LOGGING_LEVEL=LOUD is not a log level" in caplog.text
