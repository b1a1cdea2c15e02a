"""The configuration of the engine and of the server, in one package: parsed, validated and resolved here.

- `engine.py`: the engine's dataclasses (ModelConfig, CacheConfig, SchedulerConfig, SpeculativeConfig, ...,
  EngineConfig).
- `server.py`: ServerConfig, the API server's flags.
- `parallel.py`, `kv_events.py`, `generation_overrides.py`: the other sections and JSON-valued flags.
- `arguments.py`: the command-line flags generated from the dataclasses' field docstrings, and
  `configs_from_args` (a parsed namespace -> the configuration).
- `vllm_flags.py`: every `vllm serve` flag, honoured, accepted (no effect here) or refused; `config_file.py`:
  `--config FILE` (YAML, vLLM's format).
- `bounds.py`: the numeric bounds every field is checked against.

Environment variables are read in pagedllm/envs.py.
"""

from pagedllm.config.arguments import (  # noqa: F401
    add_dataclass_flags,
    add_engine_flags,
    add_vllm_only_flags,
    configs_from_args,
    engine_kwargs_from_args,
    field_docs,
    human_readable_int,
    parse_bytes,
)
from pagedllm.config.engine import (  # noqa: F401
    QUANTIZATION_METHODS,
    SPECULATIVE_METHODS,
    STRUCTURED_OUTPUT_BACKENDS,
    CacheConfig,
    EngineConfig,
    GiB,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from pagedllm.config.kv_events import KVEventsConfig  # noqa: F401
from pagedllm.config.lora import LoRAConfig  # noqa: F401
from pagedllm.config.parallel import EXECUTOR_BACKENDS, RAY_EXTRA_HINT, ParallelConfig  # noqa: F401
from pagedllm.config.server import REASONING_PARSERS, TOOL_CALL_PARSERS, ServerConfig, parse_api_keys  # noqa: F401
