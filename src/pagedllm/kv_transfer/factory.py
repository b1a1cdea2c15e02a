"""KVConnectorFactory: connectors by name (vLLM's registry and names). A new connector is one new module plus one
register_connector line below; kv_connector_module_path loads a class from any module instead."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.kv_transfer.base import KVConnectorBase, KVConnectorRole


class KVConnectorFactory:
    _registry: dict[str, Callable[[], type[KVConnectorBase]]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        """Register `module_path.class_name` under `name` (imported only when used)."""
        if name in cls._registry:
            raise ValueError(f"KV connector {name!r} is already registered.")
        cls._registry[name] = lambda: getattr(importlib.import_module(module_path), class_name)

    @classmethod
    def get_connector_class(cls, config: EngineConfig) -> type[KVConnectorBase]:
        ktc = config.kv_transfer_config
        if ktc.kv_connector_module_path:
            return getattr(importlib.import_module(ktc.kv_connector_module_path), ktc.kv_connector)
        if ktc.kv_connector not in cls._registry:
            raise ValueError(f"unknown kv_connector {ktc.kv_connector!r} in --kv-transfer-config; known: "
                             f"{', '.join(sorted(cls._registry))}.")
        return cls._registry[ktc.kv_connector]()

    @classmethod
    def create_connector(cls, config: EngineConfig, role: KVConnectorRole,
                         kv_rank: tuple[int, int, int] = (0, 0, 1)) -> KVConnectorBase:
        return cls.get_connector_class(config)(config, role, kv_rank)


def create_kv_connector(config: EngineConfig, role: KVConnectorRole,
                        kv_rank: tuple[int, int, int] = (0, 0, 1)) -> KVConnectorBase | None:
    """The configured connector for `role`, or None without --kv-transfer-config / --kv-offloading-size."""
    if config.kv_transfer_config is None:
        return None
    return KVConnectorFactory.create_connector(config, role, kv_rank)


KVConnectorFactory.register_connector("MultiConnector", "pagedllm.kv_transfer.multi_connector", "MultiConnector")
KVConnectorFactory.register_connector("PagedLLMPDConnector", "pagedllm.kv_transfer.pd_connector", "PDConnector")
KVConnectorFactory.register_connector("NixlConnector", "pagedllm.kv_transfer.pd_connector", "PDConnector")
KVConnectorFactory.register_connector("OffloadingConnector", "pagedllm.kv_transfer.offloading.connector",
                                      "OffloadingConnector")
