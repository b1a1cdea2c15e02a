"""OffloadingWorker: the OffloadingConnector's worker side: the copies between this rank's pool and the store.

A slot holds one block of this rank over all layers: [num_layers, 2 (K, V), block words] where a block's words
are its [block_size, kv_heads, head_dim] elements seen as 8-, 4-, 2- or 1-byte words (the copies move bytes;
any KV dtype, fp8 included). A pool on the CPU is copied with numpy, one assignment per block and layer: single-
threaded (a background copy must not start a second OpenMP team beside the forward's) and, measured on SmolLM2's
blocks, 3x faster than torch's index_select + index_copy_ per layer (benchmarks/RESULTS.md); numpy releases the
GIL while it copies. A pool on another device goes through torch, one gather per layer and direction.

Saves run on a background thread: wait_for_save hands the step's save list to it and returns; the next step's
start_load_kv waits for it to end before anything writes the pool (a block freed after this step may be given
to another request and overwritten by the next forward, never before its copy ended). Loads are synchronous in
start_load_kv: they are memcpys, and the step that admits the request needs them (async_save false runs the saves
synchronously too, to measure).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedllm.kv_transfer.offloading.disk import _HEADER
from pagedllm.kv_transfer.offloading.region import reap_orphans
from pagedllm.kv_transfer.offloading.spec import DEFAULT_PREFIX
from pagedllm.kv_transfer.offloading.store import BlockStore, StoreGeometry
from pagedllm.kv_transfer.stats import add_stats, stat_key

if TYPE_CHECKING:
    from pagedllm.kv_transfer.offloading.spec import OffloadSpec

logger = logging.getLogger(__name__)

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
POOL_TO_CPU, CPU_TO_POOL = "GPU_to_CPU", "CPU_to_GPU"
"""vLLM's transfer_type label values; "GPU" names the engine's KV cache (on CPU in pagedllm)."""


def _word_view(kv: torch.Tensor) -> torch.Tensor:
    """[2, num_blocks, ...] -> [2, num_blocks, words] of the widest word size dividing a block's bytes."""
    flat = kv.reshape(kv.shape[0], kv.shape[1], -1).view(torch.uint8)
    nbytes = flat.shape[-1]
    size, dtype = next((s, d) for s, d in _WORDS if nbytes % s == 0)
    return flat.view(dtype)


class OffloadingWorker:
    def __init__(self, spec: OffloadSpec, tp_rank: int):
        self.spec = spec
        self.rank = tp_rank
        self.store: BlockStore | None = None
        self.layers: list[torch.Tensor] = []
        self.ram: torch.Tensor | None = None
        """The RAM tier's slots as [num_slots * num_layers, 2, words] (slot s, layer l at s * L + l)."""
        self.np_layers: list[np.ndarray] | None = None
        self.np_ram: np.ndarray | None = None
        """numpy views of the same (a pool on the CPU); None otherwise."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-offload-save") \
            if spec.async_save else None
        self._saving: Future | None = None
        self._errors: set[int] = set()
        self._stats: dict[str, float] = {}
        self._stats_lock = threading.Lock()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The pool's layers (again after sleep mode's wake-up: the same geometry); {}: sleep mode drops them."""
        self._wait_saves()
        self.layers, self.np_layers = [], None
        if not kv_caches:
            return
        self.layers = [_word_view(kv) for kv in kv_caches.values()]
        first = self.layers[0]
        words, dtype = first.shape[-1], first.dtype
        if any(layer.shape[-1] != words or layer.dtype != dtype for layer in self.layers):
            raise ValueError("OffloadingConnector: the layers' KV blocks differ in size; not supported.")
        slot_bytes = len(self.layers) * 2 * words * first.element_size()
        ram_slots = self.spec.cpu_bytes_to_use // slot_bytes
        if ram_slots < 1:
            raise ValueError(f"OffloadingConnector: cpu_bytes_to_use {self.spec.cpu_bytes_to_use} holds no block "
                             f"({slot_bytes} bytes per block and rank).")
        disk_slots = self.spec.disk_bytes_to_use // (slot_bytes + _HEADER.size) if self.spec.disk_dir else 0
        layout = [(tuple(kv.shape[2:]), str(kv.dtype)) for kv in kv_caches.values()]
        digest = int.from_bytes(hashlib.sha256(repr(layout).encode()).digest()[:7], "little")
        geometry = StoreGeometry(slot_bytes, ram_slots, disk_slots, digest)
        if self.store is None:
            reap_orphans(self.spec.shm_dir, DEFAULT_PREFIX, self.spec.shm_name)  # left by killed processes
            self.store = BlockStore.attach(self.spec.path, geometry, self.spec.disk_dir)
        elif self.store.geometry != geometry:
            raise ValueError("OffloadingConnector: the KV cache came back with another layout.")
        ram = torch.frombuffer(self.store.data, dtype=torch.uint8).view(dtype)
        self.ram = ram.view(ram_slots * len(self.layers), 2, words)
        if all(layer.device.type == "cpu" for layer in self.layers):
            self.np_layers = [layer.numpy() for layer in self.layers]
            self.np_ram = self.ram.numpy()

    # ---- the step ------------------------------------------------------------------------------
    def start_load_kv(self, meta: dict[str, Any]) -> None:
        self._wait_saves()
        loads = meta.get("load")
        if not loads:
            return
        if self.store is None or not self.layers:  # no pool (asleep): nothing loaded
            self._errors.update(int(b) for b, _ in loads)
            return
        start = time.perf_counter()
        result = self.store.get([(int(b), bytes(h)) for b, h in loads], self.rank, self._copy_out, self._copy_bytes)
        slot_bytes = self.store.geometry.slot_bytes
        self._errors.update(result.failed)
        self._add({stat_key("vllm:kv_offload_total_bytes", CPU_TO_POOL): result.from_ram * slot_bytes,
                   stat_key("vllm:kv_offload_total_time", CPU_TO_POOL): time.perf_counter() - start,
                   stat_key("vllm:kv_offload_tiering_read_bytes", "1:disk"): result.from_disk * slot_bytes,
                   stat_key("pagedllm:kv_offload_load_errors"): len(result.failed)})

    def wait_for_save(self, meta: dict[str, Any]) -> None:
        saves = meta.get("save")
        if not saves or self.store is None or not self.layers:
            return
        # A block whose load failed this step holds garbage: never store it under its hash.
        items = [(int(b), bytes(h)) for b, h in saves if int(b) not in self._errors]
        if self._pool is None:
            self._save(items)
        else:
            self._wait_saves()
            self._saving = self._pool.submit(self._save, items)

    def _save(self, items: list[tuple[int, bytes]]) -> None:
        start = time.perf_counter()
        try:
            result = self.store.put(items, self.rank, self._copy_in)
        except Exception:
            logger.exception("KV offload: saving %d blocks failed", len(items))
            return
        slot_bytes = self.store.geometry.slot_bytes
        self._add({stat_key("vllm:kv_offload_total_bytes", POOL_TO_CPU): result.stored * slot_bytes,
                   stat_key("vllm:kv_offload_total_time", POOL_TO_CPU): time.perf_counter() - start,
                   stat_key("vllm:kv_offload_tiering_write_bytes", "1:disk"): result.spilled * slot_bytes})

    def _wait_saves(self) -> None:
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.result()

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def take_stats(self) -> dict[str, float]:
        with self._stats_lock:
            stats, self._stats = {k: v for k, v in self._stats.items() if v}, {}
        return stats

    def _add(self, stats: dict[str, float]) -> None:
        with self._stats_lock:
            add_stats(self._stats, stats)

    # ---- copies ----------------------------------------------------------------------------------
    def _slot_rows(self, slots: list[int], layer: int) -> torch.Tensor:
        return torch.tensor(slots, dtype=torch.int64) * len(self.layers) + layer

    def _copy_in(self, slots: list[int], block_ids: list[int]) -> None:
        num_layers, ram, layers = len(self.layers), self.np_ram, self.np_layers
        if layers is not None:
            for slot, block in zip(slots, block_ids, strict=True):
                base = slot * num_layers
                for i, kv in enumerate(layers):
                    ram[base + i] = kv[:, block]
            return
        blocks = torch.tensor(block_ids, dtype=torch.int64, device=self.layers[0].device)
        for i, kv in enumerate(self.layers):
            self.ram.index_copy_(0, self._slot_rows(slots, i), kv.index_select(1, blocks).transpose(0, 1).cpu())

    def _copy_out(self, slots: list[int], block_ids: list[int]) -> None:
        num_layers, ram, layers = len(self.layers), self.np_ram, self.np_layers
        if layers is not None:
            for slot, block in zip(slots, block_ids, strict=True):
                base = slot * num_layers
                for i, kv in enumerate(layers):
                    kv[:, block] = ram[base + i]
            return
        blocks = torch.tensor(block_ids, dtype=torch.int64, device=self.layers[0].device)
        for i, kv in enumerate(self.layers):
            rows = self.ram.index_select(0, self._slot_rows(slots, i)).transpose(0, 1)
            kv.index_copy_(1, blocks, rows.to(kv.device))

    def _copy_bytes(self, data: memoryview, block_id: int) -> None:
        first = self.layers[0]
        block = torch.frombuffer(data, dtype=torch.uint8).view(first.dtype).view(len(self.layers), 2, -1)
        for i, kv in enumerate(self.layers):
            kv[:, block_id] = block[i].to(kv.device)

    def shutdown(self) -> None:
        try:
            self._wait_saves()
        except Exception:
            logger.exception("KV offload: the last save failed")
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.ram = self.np_ram = self.np_layers = None
        if self.store is not None:
            self.store.close()
            self.store = None
