"""The bounds of every numeric engine and server argument, and the check that applies them at start-up.

Each config dataclass (engine.py, server.py, kv_events.py) checks its numeric fields against its
table below in `__post_init__`, so nonsense (a negative size, zero where zero means nothing, 10,000 speculative
tokens, a NaN timeout) is refused before anything starts, with a ValueError that names the flag:

    --max-num-seqs must be at most 65536, got 1000000 (...).
    --speculative-config num_speculative_tokens must be at most 128, got 10000 (...).

The upper bounds are far above any setting that works (vLLM's practical limits, the machine's, the native kernels'
32-bit arguments) and well below what would exhaust memory or overflow before a useful error. A new numeric
field needs a bound here: tests/test_config_bounds.py walks every numeric field and fails on one without.
"""

from __future__ import annotations

import functools
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DAY_S = 86400.0


@dataclass(frozen=True)
class Bound:
    """low <= value <= high (low < value when low_open); `why` says where the upper bound comes from."""

    low: float
    high: float
    low_open: bool = False
    why: str = ""

    def violation(self, value: float) -> str | None:
        """What is wrong with `value` in words ("must be at least 1, got 0"), or None when it is within the bound."""
        if isinstance(value, float) and math.isnan(value):
            return f"must be a number from {_num(self.low)} to {_num(self.high)}, got {value!r}"
        if self.low_open and not value > self.low:
            return f"must be {'positive' if self.low == 0 else f'above {_num(self.low)}'}, got {value!r}"
        if value < self.low:
            return f"must be at least {_num(self.low)}, got {value!r}"
        if value > self.high:
            return f"must be at most {_num(self.high)}, got {value!r}" + (f" ({self.why})" if self.why else "")
        return None


def at_least(low: float, high: float, why: str = "") -> Bound:
    return Bound(low, high, why=why)


def positive(high: float, why: str = "") -> Bound:
    return Bound(0, high, low_open=True, why=why)


MODEL_BOUNDS = {
    "max_model_len": at_least(1, 1 << 24, "16M tokens, past the longest context of any model"),
    "seed": at_least(-(1 << 63), (1 << 64) - 1, "torch's seeds are 64-bit"),
    "max_logprobs": at_least(-1, 1 << 24, "past the largest vocabulary"),
}
CACHE_BOUNDS = {
    "block_size": at_least(1, 1024),
    "kv_cache_memory": at_least(1, 1 << 50, "1 PiB"),
    "kv_cache_memory_bytes": at_least(1, 1 << 50, "1 PiB"),
    "gpu_memory_utilization": positive(1.0, "a fraction of the GPU's memory"),
    "num_gpu_blocks_override": at_least(1, (1 << 31) - 1, "block ids are 32-bit"),
    "kv_offloading_size": positive(1 << 20, "GiB: 1 PiB"),
}
SCHEDULER_BOUNDS = {
    "max_num_seqs": at_least(1, 1 << 16, "the persistent batch holds a row of max_model_len tokens per sequence"),
    "max_num_batched_tokens": at_least(1, 1 << 24),
    "long_prefill_token_threshold": at_least(0, 1 << 24),
    "max_prefill_attention_pairs": at_least(0, 1 << 40),
    "max_num_queued_reqs": at_least(0, 1 << 24),
    "slo_max_wait_s": positive(86400.0, "a request waits at most this long behind newer ones"),
}
LORA_BOUNDS = {
    "max_loras": at_least(1, 1 << 10, "each step applies every adapter's product separately"),
    "max_lora_rank": at_least(1, 1 << 12, "vLLM's largest rank is 512"),
    "max_cpu_loras": at_least(1, 1 << 16),
}
PARALLEL_BOUNDS = {
    "tensor_parallel_size": at_least(1, 1024),
    "pipeline_parallel_size": at_least(1, 1024),
    "data_parallel_size": at_least(1, 256, "each replica is a whole engine-core process with the model loaded"),
}
SPECULATIVE_BOUNDS = {
    "num_speculative_tokens": at_least(1, 128, "drafts past a few dozen are never all accepted: vLLM's methods "
                                               "run 1-32"),
    "prompt_lookup_min": at_least(1, 1024),
    "prompt_lookup_max": at_least(1, 1024),
    "disable_by_batch_size": at_least(2, 1 << 16, "at most --max-num-seqs' bound"),
    "verify_cost_per_draft_token": at_least(0, 1.0, "a fraction of one decode step"),
    "suffix_decoding_max_tree_depth": at_least(2, 1024),
    "suffix_decoding_max_cached_requests": at_least(0, 1 << 24),
    "suffix_decoding_max_spec_factor": positive(64.0),
    "suffix_decoding_min_token_prob": at_least(0, 1.0, "a probability"),
}
STRUCTURED_OUTPUTS_BOUNDS = {
    "compile_timeout_s": positive(3600.0),
}
KV_EVENTS_BOUNDS = {
    "buffer_steps": at_least(0, 1 << 24),
    "hwm": at_least(0, (1 << 31) - 1, "ZMQ's high-water mark is a C int"),
    "max_queue_size": at_least(0, 1 << 24),
}
SERVER_BOUNDS = {
    "port": at_least(0, 65535),
    "health_check_timeout": positive(3600.0),
    "engine_hang_timeout": at_least(0, DAY_S),
    "max_buffered_outputs": at_least(1, 1 << 24),
    "drain_timeout": at_least(0, DAY_S),
    "engine_startup_timeout": positive(DAY_S),
    "engine_death_exit_delay": at_least(0, 3600.0),
    "max_n": at_least(1, 1 << 16),
    "max_prompts": at_least(1, 1 << 20),
    "max_choices": at_least(1, 1 << 20),
    "max_logit_bias": at_least(1, 1 << 20, "past the largest vocabulary"),
    "max_stop": at_least(1, 1 << 16),
    "max_stored_responses": at_least(1, 1 << 20),
    "chat_template_timeout": positive(3600.0),
    "max_chat_template_chars": at_least(1, GiB),
    "max_request_bytes": at_least(1, 4 * GiB),
    "max_header_bytes": at_least(1, 16 * MiB),
    "max_connections": at_least(1, 1 << 24),
    "header_read_timeout": positive(3600.0),
    "body_read_timeout": positive(DAY_S),
    "max_log_len": at_least(0, 1 << 40),
    "ssl_cert_reqs": at_least(0, 2, "ssl.CERT_NONE, CERT_OPTIONAL or CERT_REQUIRED"),
    "api_server_count": at_least(1, 256),
}


def check_bounds(config, bounds: Mapping[str, Bound], json_flag: str | None = None) -> None:
    """Raise ValueError naming the flag of the first numeric field of `config` that is not a number of its type
    within its bound (None passes: it means the default). `json_flag`: the fields are keys of that JSON flag
    (`--speculative-config num_speculative_tokens`), else each is its own flag (`--max-num-seqs`)."""
    kinds = numeric_fields(type(config))
    for name, bound in bounds.items():
        value = getattr(config, name)
        if value is None:
            continue
        flag = f"{json_flag} {name}" if json_flag else "--" + name.replace("_", "-")
        integer = kinds[name] is int
        if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
            raise ValueError(f"{flag} must be {'an integer' if integer else 'a number'}, got {value!r}.")
        problem = bound.violation(value)
        if problem is not None:
            raise ValueError(f"{flag} {problem}.")


@functools.cache
def numeric_fields(cls: type) -> dict[str, type]:
    """The fields of dataclass `cls` typed int or float (optionally `| None`): name -> int or float."""
    hints = typing.get_type_hints(cls)
    kinds = {}
    for f in fields(cls):
        args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
        if len(args) == 1 and args[0] in (int, float):
            kinds[f.name] = args[0]
    return kinds


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"
