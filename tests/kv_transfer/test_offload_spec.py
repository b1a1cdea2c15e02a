"""The OffloadingConnector's extra-config keys: --kv-offloading-size maps to cpu_bytes_to_use, unknown or bad keys
are refused by name, and the default region name is the same for the replicas of one server and different for
settings that could not share blocks."""

from __future__ import annotations

import pytest

from pagedllm.config import EngineConfig
from pagedllm.kv_transfer.offloading.spec import KEYS, OffloadSpec


def _config(extra: dict | None = None, **kwargs) -> EngineConfig:
    if extra is not None:
        kwargs["kv_transfer_config"] = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                        "kv_connector_extra_config": extra}
    return EngineConfig.from_kwargs(**kwargs)


def test_kv_offloading_size_and_defaults():
    spec = OffloadSpec.from_config(_config(kv_offloading_size=0.5, kv_offloading_backend="native"))
    assert spec.cpu_bytes_to_use == 1 << 29 and spec.shm_dir == "/dev/shm" and spec.async_save
    assert spec.disk_dir is None and spec.shm_name.startswith("pagedllm-kv-")
    assert spec.path == f"/dev/shm/{spec.shm_name}"
    same = OffloadSpec.from_config(_config(kv_offloading_size=0.5, data_parallel_size=2))
    assert same.shm_name == spec.shm_name  # what the replicas share
    for other in (_config(kv_offloading_size=0.5, block_size=32), _config(kv_offloading_size=1),
                  _config(kv_offloading_size=0.5, kv_cache_dtype="fp8")):
        assert OffloadSpec.from_config(other).shm_name != spec.shm_name


def test_explicit_keys(tmp_path):
    spec = OffloadSpec.from_config(_config({"cpu_bytes_to_use": 4096, "shm_name": "mine", "disk_path": str(tmp_path),
                                            "disk_bytes_to_use": 1 << 20, "async_save": False}))
    assert (spec.path, spec.disk_dir, spec.async_save) == ("/dev/shm/mine", f"{tmp_path}/mine", False)
    assert set(KEYS) == {"cpu_bytes_to_use", "shm_name", "shm_dir", "disk_path", "disk_bytes_to_use", "async_save"}


@pytest.mark.parametrize(("extra", "message"), [
    ({"cpu_bytes_to_use": 1, "num_cpu_blocks": 4}, "unknown kv_connector_extra_config key"),
    ({}, "cpu_bytes_to_use > 0"),
    ({"cpu_bytes_to_use": -1}, "non-negative integer"),
    ({"cpu_bytes_to_use": 1, "disk_bytes_to_use": 10}, "needs disk_path"),
    ({"cpu_bytes_to_use": 1, "shm_name": "a/b"}, "file name"),
    ({"cpu_bytes_to_use": 1, "async_save": "yes"}, "true or false"),
])
def test_bad_keys_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        OffloadSpec.from_config(_config(extra))
