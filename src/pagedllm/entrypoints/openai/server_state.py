"""ServerState: what the routes, the middleware and the drain share."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from pagedllm.config import ServerConfig
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.serving_models import ServingModels


@dataclass
class ServerState:
    """What the routes share: the engine, the serve flags, the names clients may ask for, and the drain."""

    engine: AsyncLLM
    config: ServerConfig
    served_model_names: list[str]
    draining: bool = False
    salt_secret: bytes = field(default_factory=lambda: os.urandom(32))
    """--cache-salt-from-api-key's HMAC key: random per server, the same in every API server of one (a tenant's
    requests share prefix-cache blocks whichever API server takes them)."""
    started: float = field(default_factory=time.time)
    parallel: dict[str, int] = field(default_factory=dict)
    """The engine's data/tensor/pipeline-parallel sizes (ParallelConfig's names), for the live page."""
    models: ServingModels | None = None
    """The base model's names and the LoRA adapters (None: the served names alone, no adapters)."""

    def __post_init__(self) -> None:
        if self.models is None:
            self.models = ServingModels(self.served_model_names, self.engine.ready.model_name)
