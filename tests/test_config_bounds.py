"""Every numeric engine and server argument is bounded: nonsense is refused at start-up with a ValueError naming
the flag (before: `num_speculative_tokens: 10000`, a negative --port, a NaN timeout or a --max-num-seqs of a billion
were accepted silently). The walk covers every numeric field of the configuration dataclasses, so a new field
without a bound (config/bounds.py) fails here."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import fields

import pytest

from pagedllm.config import (
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from pagedllm.config.bounds import numeric_fields
from pagedllm.config.kv_events import KVEventsConfig
from pagedllm.config.server import ServerConfig

CONFIGS = {  # each dataclass -> (the smallest valid arguments, how its fields are named in messages)
    ModelConfig: ({}, None),
    CacheConfig: ({}, None),
    SchedulerConfig: ({}, None),
    ParallelConfig: ({}, None),
    LoRAConfig: ({}, None),
    SpeculativeConfig: ({"method": "suffix", "num_speculative_tokens": 4}, "--speculative-config"),
    StructuredOutputsConfig: ({}, "--structured-outputs-config"),
    KVEventsConfig: ({}, "--kv-events-config"),
    ServerConfig: ({}, None),
}
ZERO_IS_VALID = {  # the fields where 0 means something; everywhere else 0 must be refused
    "port": "any free port",
    "long_prefill_token_threshold": "no cap", "max_prefill_attention_pairs": "no cap",
    "max_num_queued_reqs": "every request refused", "seed": "a seed", "suffix_decoding_max_cached_requests":
    "no global tree", "suffix_decoding_min_token_prob": "no cut", "verify_cost_per_draft_token": "always k drafts",
    "buffer_steps": "no replay buffer", "hwm": "no high-water mark", "max_queue_size": "unbounded",
    "engine_hang_timeout": "never", "drain_timeout": "abort at once", "engine_death_exit_delay": "exit at once",
    "ssl_cert_reqs": "ssl.CERT_NONE", "max_log_len": "nothing of the text",
    "max_logprobs": "only the sampled token's logprob",
}
NEGATIVE_IS_VALID = {"seed", "max_logprobs"}  # torch takes seeds in [-2**63, 2**64); --max-logprobs -1: no cap


def _numeric_cases():
    for cls, (base, json_flag) in CONFIGS.items():
        for name, kind in numeric_fields(cls).items():
            flag = f"{json_flag} {name}" if json_flag else "--" + name.replace("_", "-")
            absurd = [10**30]  # past every bound, 64-bit seeds included
            absurd.append(-(10**30) if name in NEGATIVE_IS_VALID else -1)
            if name not in ZERO_IS_VALID:
                absurd.append(0)
            if kind is float:
                absurd += [math.nan, math.inf, -math.inf]
            else:
                absurd.append(2.5)  # an integer flag given a fraction (a JSON config, LLM(...))
            for value in absurd:
                yield pytest.param(cls, base, name, value, flag, id=f"{cls.__name__}.{name}={value!r}")


def test_the_walk_covers_every_config_and_its_numeric_fields():
    names = {name for cls in CONFIGS for name in numeric_fields(cls)}
    assert {"num_speculative_tokens", "max_num_seqs", "block_size", "port", "compile_timeout_s", "hwm",
            "data_parallel_size", "max_model_len", "gpu_memory_utilization"} <= names
    assert set(ZERO_IS_VALID) | NEGATIVE_IS_VALID <= names  # no stale exceptions
    for cls, (base, _) in CONFIGS.items():
        cls(**base)  # the defaults themselves are valid


@pytest.mark.parametrize("cls, base, name, value, flag", list(_numeric_cases()))
def test_absurd_values_are_refused_naming_the_flag(cls, base, name, value, flag):
    with pytest.raises(ValueError) as refused:
        cls(**{**base, name: value})
    assert flag in str(refused.value), str(refused.value)


@pytest.mark.parametrize("cls, base, name, value", [
    (SpeculativeConfig, {"method": "ngram"}, "num_speculative_tokens", 128),
    (SpeculativeConfig, {"method": "ngram", "num_speculative_tokens": 4}, "prompt_lookup_max", 1024),
    (ServerConfig, {}, "port", 65535),
    (ServerConfig, {}, "engine_hang_timeout", 0),
    (CacheConfig, {}, "gpu_memory_utilization", 1.0),
    (SchedulerConfig, {}, "max_num_seqs", 1 << 16),
    (ModelConfig, {}, "seed", -1),
])
def test_values_at_the_bounds_are_accepted(cls, base, name, value):
    assert getattr(cls(**{**base, name: value}), name) == value


def test_messages_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"^--speculative-config num_speculative_tokens must be at most 128, got "
                                         r"10000 \(drafts past"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=10000)
    with pytest.raises(ValueError, match=r"^--max-num-seqs must be at least 1, got 0\.$"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match=r"^--health-check-timeout must be positive, got -1\.0\.$"):
        ServerConfig(health_check_timeout=-1.0)
    with pytest.raises(ValueError, match=r"^--max-model-len must be an integer, got '4096'\.$"):
        ModelConfig(max_model_len="4096")
    assert [f.name for f in fields(ModelConfig) if f.name in numeric_fields(ModelConfig)] == [
        "max_model_len", "seed", "max_logprobs"]


@pytest.mark.slow
def test_serve_refuses_10000_speculative_tokens_at_startup():
    """The CLI stops before starting anything (no engine core, no port) and says which key is wrong."""
    result = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", "--speculative-config",
                             '{"method":"ngram","num_speculative_tokens":10000}'],
                            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode != 0
    assert "--speculative-config num_speculative_tokens must be at most 128, got 10000" in result.stderr, \
        result.stderr[-2000:]
    assert "engine core" not in result.stderr.lower()
