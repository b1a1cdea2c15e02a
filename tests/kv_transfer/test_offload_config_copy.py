"""--kv-offloading-size survives copies of the engine configuration: `pagedllm serve` copies it per engine core
(dataclasses.replace reruns EngineConfig.__post_init__) and MultiConnector copies it per sub-connector; each copy
used to wrap the tier once more (a MultiConnector of two tiers, then a RecursionError at start-up)."""

from __future__ import annotations

import dataclasses

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig
from pagedllm.config.kv_transfer import KVTransferConfig
from pagedllm.kv_transfer.base import KVConnectorRole
from pagedllm.kv_transfer.multi_connector import MultiConnector
from pagedllm.kv_transfer.offloading.connector import OffloadingConnector


def test_a_copy_keeps_the_offload_tier_as_it_was_made():
    config = EngineConfig(model_config=ModelConfig(), cache_config=CacheConfig(kv_offloading_size=0.5))
    assert config.kv_transfer_config.kv_connector == "OffloadingConnector"
    assert dataclasses.replace(config).kv_transfer_config == config.kv_transfer_config


def test_a_chained_tier_builds_its_connectors_once():
    other = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                             kv_connector_extra_config={"cpu_bytes_to_use": 1 << 20, "shm_name": "other"})
    config = EngineConfig(model_config=ModelConfig(), cache_config=CacheConfig(kv_offloading_size=0.5),
                          kv_transfer_config=other)
    copy = dataclasses.replace(config)
    assert copy.kv_transfer_config == config.kv_transfer_config
    assert [c["kv_connector"] for c in copy.kv_transfer_config.kv_connector_extra_config["connectors"]] == \
        ["OffloadingConnector", "OffloadingConnector"]
    multi = MultiConnector(copy, KVConnectorRole.SCHEDULER)
    assert [type(c) for c in multi.connectors] == [OffloadingConnector, OffloadingConnector]
    assert multi.connectors[1].spec.shm_name == "other"
    multi.shutdown()
