"""OffloadSpec: the OffloadingConnector's kv_connector_extra_config keys (connector.py lists them), checked, and
the name of the shared region every replica of the same server derives alike."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

DEFAULT_PREFIX = "pagedllm-kv-"
"""Default region names start with it (worker.py reaps orphans of that prefix)."""
KEYS = ("cpu_bytes_to_use", "shm_name", "shm_dir", "disk_path", "disk_bytes_to_use", "async_save")


@dataclasses.dataclass(frozen=True)
class OffloadSpec:
    cpu_bytes_to_use: int
    shm_dir: str
    shm_name: str
    disk_path: str | None
    disk_bytes_to_use: int
    async_save: bool

    @property
    def path(self) -> str:
        return os.path.join(self.shm_dir, self.shm_name)

    @property
    def disk_dir(self) -> str | None:
        return os.path.join(self.disk_path, self.shm_name) if self.disk_path and self.disk_bytes_to_use else None

    @classmethod
    def from_config(cls, config: EngineConfig) -> OffloadSpec:
        extra: dict[str, Any] = config.kv_transfer_config.kv_connector_extra_config
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            raise ValueError(f"OffloadingConnector: unknown kv_connector_extra_config key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(KEYS)}.")
        cpu_bytes = _non_negative_int(extra, "cpu_bytes_to_use", None)
        if not cpu_bytes:
            raise ValueError("OffloadingConnector needs kv_connector_extra_config cpu_bytes_to_use > 0 (or "
                             "--kv-offloading-size GiB).")
        disk_bytes = _non_negative_int(extra, "disk_bytes_to_use", 0)
        disk_path = extra.get("disk_path")
        if disk_path is not None and not isinstance(disk_path, str):
            raise ValueError("OffloadingConnector: disk_path must be a directory path.")
        if disk_bytes and not disk_path:
            raise ValueError("OffloadingConnector: disk_bytes_to_use needs disk_path.")
        async_save = extra.get("async_save", True)
        if not isinstance(async_save, bool):
            raise ValueError("OffloadingConnector: async_save must be true or false.")
        shm_dir = extra.get("shm_dir", "/dev/shm")
        name = extra.get("shm_name") or default_region_name(config, cpu_bytes, disk_path, disk_bytes)
        if not isinstance(name, str) or "/" in name or name in (".", ".."):
            raise ValueError(f"OffloadingConnector: shm_name must be a file name, got {name!r}.")
        return cls(cpu_bytes, shm_dir, name, os.path.abspath(disk_path) if disk_path else None, disk_bytes,
                   async_save)


def default_region_name(config: EngineConfig, cpu_bytes: int, disk_path: str | None, disk_bytes: int) -> str:
    """The same for every data-parallel replica of one server (they share the config), different for a model,
    weights file, dtype, block size, tensor-parallel size or tier size that could not share blocks."""
    mc, cc = config.model_config, config.cache_config
    model = mc.model or ""
    stamp = 0
    if os.path.exists(model):  # a local folder rewritten with other weights gets another region
        model = os.path.abspath(model)
        stamp = max((os.stat(os.path.join(model, f)).st_mtime_ns for f in os.listdir(model)), default=0) \
            if os.path.isdir(model) else os.stat(model).st_mtime_ns
    parts = [model, stamp, mc.revision, mc.dtype, mc.quantization, cc.kv_cache_dtype, cc.block_size,
             config.parallel_config.tensor_parallel_size, cpu_bytes, disk_path and os.path.abspath(disk_path),
             disk_bytes]
    digest = hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]
    return f"{DEFAULT_PREFIX}{digest}"


def _non_negative_int(extra: dict, key: str, default: int | None) -> int | None:
    value = extra.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
        raise ValueError(f"OffloadingConnector: {key} must be a non-negative integer (bytes), got {value!r}.")
    return int(value)
