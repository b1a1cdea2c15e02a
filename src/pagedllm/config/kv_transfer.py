"""KVTransferConfig: vLLM's --kv-transfer-config (the same JSON keys), and how --kv-offloading-size /
--kv-offloading-backend turn into one (vLLM's VllmConfig does the same).

A KV connector (kv_transfer/) moves KV blocks between this engine's pool and somewhere else: a CPU/disk offload
tier (OffloadingConnector), or another instance (disaggregated prefill/decode). Parsed in config/engine.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
KV_OFFLOADING_BACKENDS = ("native", "lmcache")
GiB = 1 << 30


@dataclass
class KVTransferConfig:
    kv_connector: str | None = None
    """The connector's registered name (kv_transfer/factory.py), e.g. OffloadingConnector, MultiConnector."""
    engine_id: str | None = None
    """This instance's id in transfers (default: a random uuid4)."""
    kv_buffer_device: str = "cpu"
    """Where transfer buffers live (pagedllm: cpu)."""
    kv_buffer_size: float = 1e9
    """Bytes of transfer buffer (kept for vLLM's JSON; pagedllm's connectors size their own)."""
    kv_role: str | None = None
    """kv_producer (computes prompts' KV for others), kv_consumer (loads it), or kv_both."""
    kv_rank: int | None = None
    """This instance's rank among the transfer's instances (vLLM's P2P connectors; unused by pagedllm's)."""
    kv_parallel_size: int = 1
    """Instances in the transfer (vLLM's P2P connectors; unused by pagedllm's)."""
    kv_ip: str = "127.0.0.1"
    """The address this instance's KV side channel listens on (disaggregated prefill/decode)."""
    kv_port: int = 14579
    """The side channel's port (each data-parallel rank listens on kv_port + rank)."""
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    """Connector-specific settings (each connector documents its keys)."""
    kv_connector_module_path: str | None = None
    """A module to import the connector class from instead of the registry (vLLM's dynamic loading)."""
    enable_permute_local_kv: bool = False
    """vLLM's heterogeneous-layout permute (NIXL); not used by pagedllm (one layout)."""
    kv_load_failure_policy: str = "recompute"
    """What a failed KV load does: recompute (the request computes the tokens it could not load) or fail (the one
    request ends with an error)."""

    def __post_init__(self) -> None:
        if self.kv_connector is None:
            raise ValueError("--kv-transfer-config needs kv_connector (e.g. OffloadingConnector, "
                             "PagedLLMPDConnector, MultiConnector).")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"--kv-transfer-config kv_role must be one of {', '.join(KV_ROLES)}, "
                             f"got {self.kv_role!r}.")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"--kv-transfer-config kv_load_failure_policy must be one of "
                             f"{', '.join(KV_LOAD_FAILURE_POLICIES)}, got {self.kv_load_failure_policy!r}.")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("--kv-transfer-config kv_connector_extra_config must be a JSON object.")
        if not 0 <= self.kv_port < 65536:
            raise ValueError(f"--kv-transfer-config kv_port must be in [0, 65535], got {self.kv_port}.")
        if self.engine_id is None:
            import uuid

            self.engine_id = str(uuid.uuid4())

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)


def offloading_transfer_config(size_gib: float | None, backend: str,
                               given: KVTransferConfig | None) -> KVTransferConfig | None:
    """--kv-offloading-size GiB with --kv-offloading-backend native: the OffloadingConnector with that much CPU
    memory (vLLM's mapping: kv_both, extra config cpu_bytes_to_use). Given together with --kv-transfer-config, the
    two connectors are chained (MultiConnector: the offload tier first). None size: `given` unchanged."""
    if backend not in KV_OFFLOADING_BACKENDS:
        raise ValueError(f"--kv-offloading-backend must be one of {', '.join(KV_OFFLOADING_BACKENDS)}, "
                         f"got {backend!r}.")
    if size_gib is None:
        return given
    if backend == "lmcache":
        raise ValueError("--kv-offloading-backend lmcache is not supported by pagedllm (LMCache is not "
                         "installed); use --kv-offloading-backend native.")
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"cpu_bytes_to_use": int(size_gib * GiB)}}
    if given is None:
        return KVTransferConfig(**offload)
    if _made_from(given, offload):  # a copy of a config whose offload tier was made already (dataclasses.replace)
        return given
    connectors = [offload, {k: v for k, v in vars(given).items() if k in ("kv_connector", "kv_role",
                                                                          "kv_connector_extra_config")}]
    return KVTransferConfig(kv_connector="MultiConnector", kv_role=given.kv_role, engine_id=given.engine_id,
                            kv_ip=given.kv_ip, kv_port=given.kv_port,
                            kv_load_failure_policy=given.kv_load_failure_policy,
                            kv_connector_extra_config={"connectors": connectors})


def _made_from(given: KVTransferConfig, offload: dict[str, Any]) -> bool:
    """`given` is what offloading_transfer_config made of `offload` (alone, or first in a MultiConnector)."""
    if given.kv_connector == "OffloadingConnector":
        return given.kv_connector_extra_config == offload["kv_connector_extra_config"]
    connectors = given.kv_connector_extra_config.get("connectors") if given.kv_connector == "MultiConnector" else None
    return bool(connectors) and connectors[0] == offload
