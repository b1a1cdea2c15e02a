"""--speculative-config / LLM(speculative_config=...): vLLM's keys, and clear errors for what does not run."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from pagedllm.bench.engine_args import add_engine_args, engine_kwargs
from pagedllm.config import EngineConfig, SpeculativeConfig
from pagedllm.entrypoints.cli.serve import add_parser, configs_from_args


def test_serve_flag_parses_vllm_json_and_crosses_to_the_engine_process(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    parser = add_parser(argparse.ArgumentParser(prog="pagedllm").add_subparsers())
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                                                      '"prompt_lookup_max": 4, "disable_by_batch_size": 8}'])
    engine, _ = configs_from_args(args)
    spec = engine.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
            spec.disable_by_batch_size) == ("ngram", 3, 4, 4, 8)
    assert msgspec.json.decode(msgspec.json.encode(engine), type=EngineConfig) == engine  # the stdin handoff
    assert configs_from_args(parser.parse_args([]))[0].speculative_config is None
    bench = argparse.ArgumentParser()
    add_engine_args(bench)
    assert engine_kwargs(bench.parse_args(["--speculative-config", '{"model": "[ngram]", '
                                                                   '"num_speculative_tokens": 2}'])) == {
        "speculative_config": '{"model": "[ngram]", "num_speculative_tokens": 2}'}


def test_defaults_and_inference_follow_vllm():
    spec = SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2})
    assert (spec.method, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 5, 5)
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (2, 2)
    spec = SpeculativeConfig.parse({"model": "some/draft", "num_speculative_tokens": 4})
    assert (spec.method, spec.model) == ("draft_model", "some/draft")


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "'eagle' is not supported by pagedllm"),
    ({"method": "mtp", "num_speculative_tokens": 1}, "'mtp' is not supported by pagedllm"),
    ({"method": "medusa2", "num_speculative_tokens": 1}, "supported: ngram, suffix"),
    ({"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 1}, "at least 2"),
    ({"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_cached_requests": -1}, "at least 0"),
    ({"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_spec_factor": 0}, "must be positive"),
    ({"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_min_token_prob": 1.5}, "at most 1, got 1.5"),
    ({"method": "draft_model", "num_speculative_tokens": 4}, "needs \"model\""),
    ({"method": "ngram"}, "num_speculative_tokens >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown --speculative-config keys: lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, "at least 2"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_unsupported_or_invalid_configs_are_startup_errors(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        EngineConfig.from_kwargs(speculative_config=value)
