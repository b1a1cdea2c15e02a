"""BlockStore: full KV blocks by block hash, in a shared-memory RAM tier and an optional disk tier below it.

The region (region.py) holds, in order: a 4 KiB header of int64 words (HEADER_WORDS), the RAM tier's index, the
disk tier's index (index.py; empty without a disk tier), then from a 4 KiB boundary the RAM tier's slots, each
one block of one tensor-parallel rank over all layers (`slot_bytes`). The disk tier's bytes are files
(disk.py). A block evicted from RAM (LRU) is written to the disk tier, which evicts its own LRU block.

Every call takes the region's lock only around index updates; the bytes are copied outside it (readers validate
their slot's version afterwards, index.py). The caller supplies the copies between the engine's pool and the
slots (connector.py: torch, batched per layer), so this module knows bytes, not tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import numpy as np

from pagedllm.kv_transfer.offloading.disk import DiskFiles
from pagedllm.kv_transfer.offloading.index import SlotIndex, index_nbytes, make_key
from pagedllm.kv_transfer.offloading.region import SharedRegion

MAGIC = 0x504C4B564F46464C  # "PLKVOFFL"
LAYOUT_VERSION = 1
HEADER_BYTES = 4096
W_MAGIC, W_VERSION, W_SLOT_BYTES, W_RAM_SLOTS, W_DISK_SLOTS, W_CLOCK, W_LAYOUT = range(7)
HEADER_WORDS = HEADER_BYTES // 8
RAM, DISK = 0, 1
"""Tiers, as lookup reports them."""


@dataclasses.dataclass(frozen=True)
class StoreGeometry:
    slot_bytes: int
    """One block of one rank over all layers, K and V."""
    ram_slots: int
    disk_slots: int
    layout: int
    """A digest of the per-layer shapes and dtype (two workers that disagree must not share slots)."""

    @property
    def data_offset(self) -> int:
        end = HEADER_BYTES + index_nbytes(self.ram_slots) + (index_nbytes(self.disk_slots) if self.disk_slots else 0)
        return -(-end // 4096) * 4096

    @property
    def region_bytes(self) -> int:
        return self.data_offset + self.ram_slots * self.slot_bytes


@dataclasses.dataclass
class PutResult:
    stored: int = 0
    """Blocks copied into the RAM tier."""
    spilled: int = 0
    """Blocks evicted from RAM and written to the disk tier."""


@dataclasses.dataclass
class GetResult:
    failed: list[int] = dataclasses.field(default_factory=list)
    """Block ids not loaded (missing, overwritten meanwhile, or a disk file that does not check out)."""
    from_ram: int = 0
    from_disk: int = 0


class BlockStore:
    def __init__(self, region: SharedRegion, geometry: StoreGeometry, disk_dir: str | None):
        self.region = region
        self.geometry = geometry
        buf = memoryview(region.map)
        self.header = np.frombuffer(buf, dtype=np.int64, count=HEADER_WORDS)
        self.ram = SlotIndex(buf, HEADER_BYTES, geometry.ram_slots, self.header, W_CLOCK)
        self.disk: SlotIndex | None = None
        self.files: DiskFiles | None = None
        if geometry.disk_slots and disk_dir:
            self.disk = SlotIndex(buf, HEADER_BYTES + index_nbytes(geometry.ram_slots), geometry.disk_slots,
                                  self.header, W_CLOCK)
            self.files = DiskFiles(disk_dir)
        self.data = buf[geometry.data_offset:geometry.region_bytes]
        """The RAM tier's slots, slot i at [i * slot_bytes, (i + 1) * slot_bytes)."""

    @classmethod
    def attach(cls, path: str, geometry: StoreGeometry | None, disk_dir: str | None) -> BlockStore | None:
        """Create or attach (geometry given: a worker), or attach only (None: the scheduler side; None back
        while no worker has created the region)."""
        def init(buf: memoryview) -> None:
            header = np.frombuffer(buf, dtype=np.int64, count=HEADER_WORDS)
            header[[W_MAGIC, W_VERSION, W_SLOT_BYTES, W_RAM_SLOTS, W_DISK_SLOTS, W_LAYOUT]] = [
                MAGIC, LAYOUT_VERSION, geometry.slot_bytes, geometry.ram_slots, geometry.disk_slots, geometry.layout]
            SlotIndex(buf, HEADER_BYTES, geometry.ram_slots, header, W_CLOCK).initialize()
            if geometry.disk_slots:
                SlotIndex(buf, HEADER_BYTES + index_nbytes(geometry.ram_slots), geometry.disk_slots, header,
                          W_CLOCK).initialize()
                if disk_dir:  # files of an earlier region of this name (a crash) are stale
                    DiskFiles(disk_dir).remove_all()

        def check(buf: memoryview) -> bool:
            if len(buf) < HEADER_BYTES:
                return False
            header = np.frombuffer(buf, dtype=np.int64, count=HEADER_WORDS)
            if header[W_MAGIC] != MAGIC or header[W_VERSION] != LAYOUT_VERSION:
                return False
            found = StoreGeometry(*(int(header[w]) for w in (W_SLOT_BYTES, W_RAM_SLOTS, W_DISK_SLOTS, W_LAYOUT)))
            return (geometry is None or found == geometry) and len(buf) >= found.region_bytes

        region = SharedRegion.attach(path, geometry.region_bytes if geometry else None, init, check)
        if region is None:
            return None
        if geometry is None:
            header = np.frombuffer(region.map, dtype=np.int64, count=HEADER_WORDS)
            geometry = StoreGeometry(*(int(header[w]) for w in (W_SLOT_BYTES, W_RAM_SLOTS, W_DISK_SLOTS, W_LAYOUT)))
            del header
        if disk_dir and geometry.disk_slots:
            region.on_last.append(DiskFiles(disk_dir).remove_all)
        return cls(region, geometry, disk_dir)

    def close(self) -> None:
        """Drop this attachment (the host's last user unlinks the region and removes the disk tier's files)."""
        if self.region is None:
            return
        self.ram.close()
        if self.disk is not None:
            self.disk.close()
        with contextlib.suppress(BufferError):  # a view of it still alive: it goes with the mapping
            self.data.release()
        self.header = None
        region, self.region = self.region, None
        region.detach()

    def slot(self, index: int) -> memoryview:
        size = self.geometry.slot_bytes
        return self.data[index * size:(index + 1) * size]

    # ---- the scheduler side --------------------------------------------------------------------
    def lookup(self, block_hashes: list[bytes], num_ranks: int) -> list[int]:
        """The tier of each block of the longest prefix of `block_hashes` present for every rank (DISK if any
        rank's copy is on disk only); the blocks found are touched (most recently used)."""
        tiers: list[int] = []
        with self.region.lock():
            for block_hash in block_hashes:
                tier = RAM
                for rank in range(num_ranks):
                    key = make_key(block_hash, rank)
                    if self.ram.find_ready(key)[0] >= 0:
                        continue
                    if self.disk is None or self.disk.find_ready(key)[0] < 0:
                        return tiers
                    tier = DISK
                tiers.append(tier)
        return tiers

    def num_blocks(self) -> tuple[int, int]:
        """Blocks held (RAM, disk), every rank's counted."""
        with self.region.lock():
            return self.ram.num_ready(), self.disk.num_ready() if self.disk is not None else 0

    # ---- the worker side -----------------------------------------------------------------------
    def put(self, items: list[tuple[int, bytes]], rank: int,
            copy_in: Callable[[list[int], list[int]], None]) -> PutResult:
        """Store (block id, block hash) pairs of this rank that the RAM tier lacks (present ones are touched):
        `copy_in(slots, block_ids)` copies the pool's blocks into those slots. RAM's evicted blocks go to disk."""
        reserved: list[tuple[int, int, int]] = []
        spills: list[tuple[int, int, int, bytes]] = []
        with self.region.lock():
            missing = []
            for block_id, block_hash in items:
                key = make_key(block_hash, rank)
                slot = self.ram.find(key)
                if slot >= 0:
                    self.ram.touch(slot)  # present: most recently used, so not among the victims below
                else:
                    missing.append((block_id, key))
            victims = self.ram.victims(len(missing))
            disk_victims = self.disk.victims(len(missing)) if self.disk is not None and missing else None
            for block_id, key in missing:
                got = self.ram.reserve(key, victims)
                if got is None:
                    continue
                slot, version, victim = got
                reserved.append((slot, version, block_id))
                if victim is not None and self.disk is not None:
                    spot = self.disk.reserve(victim, disk_victims)
                    if spot is not None:
                        spills.append((slot, spot[0], spot[1], victim))
        result = PutResult()
        written = []
        for ram_slot, disk_slot, disk_version, victim in spills:  # before the RAM slot is overwritten
            try:
                self.files.write(disk_slot, victim, self.slot(ram_slot))
                written.append((disk_slot, disk_version, True))
            except OSError:
                written.append((disk_slot, disk_version, False))
        try:
            if reserved:
                copy_in([s for s, _, _ in reserved], [b for _, _, b in reserved])
        except BaseException:
            with self.region.lock():
                for slot, version, _ in reserved:
                    self.ram.drop(slot, version)
            raise
        with self.region.lock():
            for disk_slot, disk_version, ok in written:
                if ok and self.disk.commit(disk_slot, disk_version):
                    result.spilled += 1
                else:
                    self.disk.drop(disk_slot, disk_version)
            for slot, version, _ in reserved:
                result.stored += self.ram.commit(slot, version)
        return result

    def get(self, items: list[tuple[int, bytes]], rank: int, copy_out: Callable[[list[int], list[int]], None],
            copy_bytes: Callable[[memoryview, int], None]) -> GetResult:
        """Load (block id, block hash) pairs of this rank into the pool: `copy_out(slots, block_ids)` from RAM
        slots, `copy_bytes(one slot's bytes, block_id)` from a disk file. A disk entry whose file does not check
        out is dropped."""
        result = GetResult()
        from_ram: list[tuple[int, int, int]] = []
        from_disk: list[tuple[int, int, int, bytes]] = []
        with self.region.lock():
            for block_id, block_hash in items:
                key = make_key(block_hash, rank)
                slot, version = self.ram.find_ready(key)
                if slot >= 0:
                    from_ram.append((slot, version, block_id))
                    continue
                if self.disk is not None:
                    slot, version = self.disk.find_ready(key)
                    if slot >= 0:
                        from_disk.append((slot, version, block_id, key))
                        continue
                result.failed.append(block_id)
        if from_ram:
            copy_out([s for s, _, _ in from_ram], [b for _, _, b in from_ram])
        corrupted = []
        if from_disk:
            buf = bytearray(self.geometry.slot_bytes)
            for slot, version, block_id, key in from_disk:
                if self.files.read(slot, key, memoryview(buf)):
                    copy_bytes(memoryview(buf), block_id)
                    result.from_disk += 1
                else:
                    corrupted.append((slot, version))
                    result.failed.append(block_id)
        with self.region.lock():
            for slot, version, block_id in from_ram:
                if self.ram.valid(slot, version):
                    result.from_ram += 1
                else:
                    result.failed.append(block_id)
            for slot, version in corrupted:
                if self.disk.valid(slot, version):
                    self.disk.drop(slot, version)
                    self.files.remove(slot)
        return result
