"""The offload tier's shared store without an engine: the shared-memory index (hash table with backward-shift
deletion, LRU, versions), RAM -> disk spill, CRC-checked disk files, and the region's life across processes
(the last user unlinks it, a killed user does not keep it alive)."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import time
import uuid

import pytest

from pagedllm.kv_transfer.offloading.index import make_key
from pagedllm.kv_transfer.offloading.region import reap_orphans
from pagedllm.kv_transfer.offloading.store import DISK, RAM, BlockStore, StoreGeometry

SLOT = 64


def _hash(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def _geometry(ram_slots: int, disk_slots: int = 0) -> StoreGeometry:
    return StoreGeometry(SLOT, ram_slots, disk_slots, 7)


@pytest.fixture
def shm_path(tmp_path):
    path = f"/dev/shm/pagedllm-test-{uuid.uuid4().hex}"
    yield path
    assert not os.path.exists(path), "the region outlived its last user"


class _Pool:
    """A fake engine pool: block id -> its bytes; the copy callbacks the worker side would pass."""

    def __init__(self, store: BlockStore):
        self.store = store
        self.blocks: dict[int, bytes] = {}

    def copy_in(self, slots, block_ids):
        for slot, block_id in zip(slots, block_ids, strict=True):
            self.store.slot(slot)[:] = self.blocks[block_id]

    def copy_out(self, slots, block_ids):
        for slot, block_id in zip(slots, block_ids, strict=True):
            self.blocks[block_id] = bytes(self.store.slot(slot))

    def copy_bytes(self, data, block_id):
        self.blocks[block_id] = bytes(data)

    def put(self, ids, rank=0):
        return self.store.put([(i, _hash(i)) for i in ids], rank, self.copy_in)

    def get(self, ids, rank=0):
        for i in ids:
            self.blocks.pop(i, None)
        return self.store.get([(i, _hash(i)) for i in ids], rank, self.copy_out, self.copy_bytes)


def test_index_matches_a_model_under_random_use(shm_path):
    """Random puts over more keys than slots: every key the store reports present loads its own bytes, at most
    ram_slots are present, and the table never loses a key it holds (backward-shift deletion)."""
    store = BlockStore.attach(shm_path, _geometry(13), None)
    pool = _Pool(store)
    rng = random.Random(1)
    for i in range(200):
        pool.blocks[i] = bytes([i % 251]) * SLOT
    for _ in range(300):
        ids = rng.sample(range(60), rng.randrange(1, 5))
        pool.put(ids)
        present = [i for i in range(60) if store.lookup([_hash(i)], 1)]
        assert len(present) == store.num_blocks()[0] <= 13
        result = pool.get(present)
        assert not result.failed
        assert all(pool.blocks[i] == bytes([i % 251]) * SLOT for i in present)
    store.close()


def test_lru_eviction_keeps_the_recently_used(shm_path):
    store = BlockStore.attach(shm_path, _geometry(4), None)
    pool = _Pool(store)
    pool.blocks = {i: bytes([i]) * SLOT for i in range(8)}
    pool.put([0, 1, 2, 3])
    assert store.lookup([_hash(0)], 1) == [RAM]  # touches 0: 1 is now the least recently used
    pool.put([4])
    assert not store.lookup([_hash(1)], 1)
    assert store.lookup([_hash(0)], 1) == [RAM] and store.lookup([_hash(4)], 1) == [RAM]
    assert store.lookup([_hash(0), _hash(4), _hash(1), _hash(2)], 1) == [RAM, RAM]  # the prefix up to a miss
    store.close()


def test_ranks_are_separate_keys_and_lookup_needs_every_rank(shm_path):
    store = BlockStore.attach(shm_path, _geometry(8), None)
    pool = _Pool(store)
    pool.blocks = {0: b"a" * SLOT, 1: b"b" * SLOT}
    pool.put([0, 1], rank=0)
    assert store.lookup([_hash(0), _hash(1)], 2) == []  # rank 1 has not stored them
    pool.put([0], rank=1)
    assert store.lookup([_hash(0), _hash(1)], 2) == [RAM]
    assert make_key(_hash(0), 0) != make_key(_hash(0), 1)
    store.close()


def test_eviction_spills_to_disk_and_corruption_is_detected(shm_path, tmp_path):
    disk_dir = str(tmp_path / "disk")
    store = BlockStore.attach(shm_path, _geometry(2, disk_slots=3), disk_dir)
    pool = _Pool(store)
    pool.blocks = {i: bytes([i + 1]) * SLOT for i in range(6)}
    for i in range(6):
        pool.put([i])
    assert store.num_blocks() == (2, 3)  # 4, 5 in RAM; 1, 2, 3 on disk; 0 evicted from disk (LRU)
    assert store.lookup([_hash(i) for i in (1, 2, 3, 4)], 1) == [DISK, DISK, DISK, RAM]
    assert not store.lookup([_hash(0)], 1)
    result = pool.get([1, 4])
    assert (result.failed, result.from_disk, result.from_ram) == ([], 1, 1)
    assert pool.blocks[1] == bytes([2]) * SLOT and pool.blocks[4] == bytes([5]) * SLOT
    files = sorted(os.listdir(disk_dir))
    assert len(files) == 3
    for name in files:  # flip a byte of every file's data
        with open(os.path.join(disk_dir, name), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
    result = pool.get([2, 3])
    assert sorted(result.failed) == [2, 3] and result.from_disk == 0
    assert not store.lookup([_hash(2)], 1) and not store.lookup([_hash(3)], 1)  # dropped
    store.close()
    assert not os.path.exists(disk_dir), "the last user removes the disk tier's files"


def test_a_reader_sees_a_slot_overwritten_meanwhile(shm_path):
    """The seqlock-ish check: a slot given to another key while it was being copied out is a failed load."""
    store = BlockStore.attach(shm_path, _geometry(1), None)
    pool = _Pool(store)
    pool.blocks = {0: b"x" * SLOT, 1: b"y" * SLOT}
    pool.put([0])

    def copy_out_while_evicted(slots, block_ids):
        pool.put([1])  # another writer takes the only slot mid-copy
        pool.copy_out(slots, block_ids)

    result = store.get([(0, _hash(0))], 0, copy_out_while_evicted, pool.copy_bytes)
    assert result.failed == [0]
    store.close()


def _child_put(path: str, geometry: StoreGeometry, crash: bool) -> None:
    store = BlockStore.attach(path, geometry, None)
    store.put([(0, _hash(42))], 0, lambda slots, ids: store.slot(slots[0]).__setitem__(slice(None), b"z" * SLOT))
    if crash:
        os._exit(0)  # killed: no detach
    store.close()


@pytest.mark.parametrize("crash", [False, True])
def test_region_shared_across_processes_and_unlinked_by_the_last_user(shm_path, crash):
    geometry = _geometry(4)
    store = BlockStore.attach(shm_path, geometry, None)
    child = multiprocessing.get_context("fork").Process(target=_child_put, args=(shm_path, geometry, crash))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert store.lookup([_hash(42)], 1) == [RAM]  # the other process's block
    assert os.path.exists(shm_path)
    attach_only = BlockStore.attach(shm_path, None, None)
    assert attach_only.geometry == geometry
    attach_only.close()
    store.close()


def _content(i: int) -> bytes:
    return hashlib.sha256(b"block %d" % i).digest() * (SLOT // 32)


def _hammer(path: str, geometry: StoreGeometry, disk_dir: str, seed: int) -> None:
    """Random puts and gets of 6 keys in a 2-slot RAM tier and 6-slot disk tier, alongside another process:
    every block loaded must be its own key's bytes (a torn or reused slot must report a failure instead)."""
    store = BlockStore.attach(path, geometry, disk_dir)
    pool = _Pool(store)
    pool.blocks = {i: _content(i) for i in range(6)}
    rng = random.Random(seed)
    copy_out = pool.copy_out

    def slow_copy_out(slots, block_ids):  # a wider window for the other process to take the slot
        time.sleep(0.001)
        copy_out(slots, block_ids)

    pool.copy_out = slow_copy_out
    bad = 0
    for _ in range(300):
        ids = rng.sample(range(6), 2)
        if rng.random() < 0.5:
            pool.put(ids)
        else:
            result = pool.get(ids)
            bad += sum(pool.blocks.get(i) != _content(i) for i in ids if i not in result.failed)
            for i in ids:
                pool.blocks[i] = _content(i)
    store.close()
    os._exit(1 if bad else 0)


def test_two_processes_at_once_never_read_a_torn_block(shm_path, tmp_path):
    geometry = _geometry(2, disk_slots=6)
    store = BlockStore.attach(shm_path, geometry, str(tmp_path / "disk"))
    ctx = multiprocessing.get_context("fork")
    children = [ctx.Process(target=_hammer, args=(shm_path, geometry, str(tmp_path / "disk"), seed))
                for seed in (1, 2)]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
    assert [child.exitcode for child in children] == [0, 0]
    assert store.num_blocks()[0] <= 2
    store.close()


def test_attach_only_finds_nothing_and_orphans_are_reaped(shm_path):
    assert BlockStore.attach(shm_path, None, None) is None
    assert not os.path.exists(shm_path)
    name = f"pagedllm-test-orphan-{uuid.uuid4().hex}"
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(b"left by a killed server")
    assert reap_orphans("/dev/shm", "pagedllm-none-", name) == [f"/dev/shm/{name}"]


def test_another_geometry_is_refused(shm_path):
    store = BlockStore.attach(shm_path, _geometry(4), None)
    with pytest.raises(ValueError, match="shm_name"):
        BlockStore.attach(shm_path, _geometry(5), None)
    store.close()
