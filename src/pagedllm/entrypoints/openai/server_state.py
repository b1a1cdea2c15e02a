"""ServerState: what the routes, the middleware and the drain share."""

from __future__ import annotations

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
    started: float = field(default_factory=time.time)
    models: ServingModels | None = None
    """The base model's names and the LoRA adapters (None: the served names alone, no adapters)."""

    def __post_init__(self) -> None:
        if self.models is None:
            self.models = ServingModels(self.served_model_names, self.engine.ready.model_name)
