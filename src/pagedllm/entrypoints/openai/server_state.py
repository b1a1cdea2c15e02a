"""ServerState: what the routes, the middleware and the drain share."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedllm.config import ServerConfig
from pagedllm.engine.async_llm import AsyncLLM


@dataclass
class ServerState:
    """What the routes share: the engine, the serve flags, the names clients may ask for, and the drain."""

    engine: AsyncLLM
    config: ServerConfig
    served_model_names: list[str]
    draining: bool = False
    started: float = field(default_factory=time.time)
