"""The configuration of the engine and of the server, in one package: parsed, validated and resolved here.

- `engine.py`: the engine's dataclasses (ModelConfig, CacheConfig, SchedulerConfig, SpeculativeConfig, ...,
  EngineConfig) and the command-line flags generated from their field docstrings.
- `server.py`: ServerConfig, the API server's flags.
- `parallel.py`, `kv_events.py`, `generation_overrides.py`: the other sections and JSON-valued flags.
- `bounds.py`: the numeric bounds every field is checked against.
"""

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
    add_dataclass_flags,
    add_engine_flags,
    engine_kwargs_from_args,
    field_docs,
    parse_bytes,
)
from pagedllm.config.kv_events import KVEventsConfig  # noqa: F401
from pagedllm.config.lora import LoRAConfig  # noqa: F401
from pagedllm.config.parallel import EXECUTOR_BACKENDS, RAY_EXTRA_HINT, ParallelConfig  # noqa: F401
from pagedllm.config.server import TOOL_CALL_PARSERS, ServerConfig, parse_api_keys  # noqa: F401
