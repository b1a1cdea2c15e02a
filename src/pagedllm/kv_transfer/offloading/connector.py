"""OffloadingConnector (vLLM's name): full KV blocks kept in a host-wide shared-memory RAM tier, keyed by block
hash, with an optional disk tier below it; every data-parallel replica on the host reads and writes the same
tier, so a prefix one replica computed is a hit for the others.

Enabled by `--kv-offloading-size GiB --kv-offloading-backend native`, or `--kv-transfer-config
'{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {...}}'`.

kv_connector_extra_config keys (stable):
    cpu_bytes_to_use   int, required: bytes of the RAM tier (all tensor-parallel ranks' slots together), reserved
                       in shm_dir when the first worker starts. --kv-offloading-size N sets it to N GiB.
    shm_name           the region's file name in shm_dir. Default: "pagedllm-kv-" + a digest of the model (and its
                       files' mtime), revision, dtypes, quantization, block size, tensor-parallel size and the
                       tier sizes: the replicas of one server, and servers of the same model and settings, share
                       one region; give servers that must not share their own name.
    shm_dir            default "/dev/shm".
    disk_path          a directory for the disk tier (its files go in disk_path/<shm_name>/).
    disk_bytes_to_use  int, bytes of the disk tier (0, the default: no disk tier). Blocks evicted from RAM (LRU)
                       are written there; the disk tier evicts LRU too. A file that fails its CRC on load is
                       dropped and its block recomputed.
    async_save         bool, default true: copy the step's new full blocks on a background thread (false: inside
                       the step, after the forward).

Keys: block hashes already commit to the cache salt and the LoRA adapter (core/block_hash.py), so tenants of
different salts never share a block; each tensor-parallel rank stores its own KV heads under (hash, rank), and the
scheduler counts a block present only when every rank's copy is. The region is unlinked, and the disk tier's
files removed, by its last user (region.py). Counters: kv_transfer/stats.py (per tier: tier="0:primary" RAM,
"1:disk").

The scheduler side is scheduler.py, the worker side worker.py, the shared store store.py (index.py, region.py,
disk.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.kv_transfer.base import KVConnectorBase, KVConnectorRole
from pagedllm.kv_transfer.offloading.spec import OffloadSpec
from pagedllm.kv_transfer.stats import OFFLOAD_COUNTERS, split_stat_key

if TYPE_CHECKING:
    import torch

    from pagedllm.config import EngineConfig
    from pagedllm.core.request import Request
    from pagedllm.core.scheduler_output import SchedulerOutput
    from pagedllm.messages import KVConnectorOutput


class OffloadingConnector(KVConnectorBase):
    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_rank: tuple[int, int, int] = (0, 0, 1)):
        super().__init__(config, role, kv_rank)
        self.spec = OffloadSpec.from_config(config)
        if role == KVConnectorRole.SCHEDULER:
            from pagedllm.kv_transfer.offloading.scheduler import OffloadingScheduler

            self.scheduler = OffloadingScheduler(self.spec, config.cache_config.block_size, self.tp_size)
        else:
            from pagedllm.kv_transfer.offloading.worker import OffloadingWorker

            self.worker = OffloadingWorker(self.spec, self.tp_rank)

    # ---- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> dict[str, Any]:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler.request_finished(request)
        return False, None  # the save of a request's last blocks ends before the next step writes the pool

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for key, value in connector_output.kv_connector_stats.items():  # its own only (MultiConnector)
            if split_stat_key(key)[0] in OFFLOAD_COUNTERS:
                self.scheduler.counters[key] = self.scheduler.counters.get(key, 0) + value

    def get_stats(self) -> dict[str, float]:
        return dict(self.scheduler.counters)

    # ---- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self) -> None:
        self.worker.start_load_kv(self._get_connector_metadata())

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._get_connector_metadata())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def get_kv_connector_stats(self) -> dict[str, float]:
        return self.worker.take_stats()

    def shutdown(self) -> None:
        side = self.scheduler if self.role == KVConnectorRole.SCHEDULER else self.worker
        side.shutdown()
