"""SlotIndex: one tier's index in shared memory: which key sits in which slot, with LRU stamps and versions.

A key is a block hash (32 bytes) and the tensor-parallel rank whose KV heads the slot holds (each rank stores its
own heads). Arrays (numpy views of the shared region), one entry per slot:
    keys [n, 40] (hash | uint32 rank | pad), home [n] (the key's home position in the table), state [n] (FREE,
    WRITING, READY), version [n] (bumped whenever the slot is given to a new key), stamp [n] (the LRU clock at
    the last use; -1 when free), wtime [n] (wall time of the reservation: a writer that died is evicted after
    STALE_WRITE_S)
and a hash table [m] (m a power of two >= 2n) of slot numbers, linear probing, deletion by backward shift (no
tombstones). The LRU clock is shared by the tiers (header word CLOCK).

Readers never hold the lock while they copy: they note (slot, version) under it, copy, and check under it again
that the version did not move (`valid`); a writer bumps the version under the lock before it writes a byte. So a
slot reused meanwhile is detected, not read torn. Every method runs under the region's lock.
"""

from __future__ import annotations

import time

import numpy as np

FREE, WRITING, READY = 0, 1, 2
KEY_BYTES = 40
STALE_WRITE_S = 60.0
"""A slot WRITING for longer than this belongs to a writer that died: it may be evicted."""
_INT64_MAX = np.iinfo(np.int64).max


def make_key(block_hash: bytes, rank: int) -> bytes:
    return block_hash[:32].ljust(32, b"\0") + rank.to_bytes(4, "little") + b"\0\0\0\0"


def key_home(key: bytes) -> int:
    mixed = int.from_bytes(key[:8], "little") ^ (int.from_bytes(key[32:36], "little") * 0x9E3779B97F4A7C15)
    return mixed & ((1 << 62) - 1)


def index_nbytes(num_slots: int) -> int:
    """Bytes of one tier's index arrays (see layout)."""
    return num_slots * (KEY_BYTES + 8 * 5) + table_size(num_slots) * 8


def table_size(num_slots: int) -> int:
    size = 1
    while size < 2 * max(num_slots, 1):
        size *= 2
    return size


class SlotIndex:
    def __init__(self, buf: memoryview, offset: int, num_slots: int, header: np.ndarray, clock_word: int):
        n, m = num_slots, table_size(num_slots)
        self.num_slots, self.mask = n, m - 1
        self.header, self.clock_word = header, clock_word

        def array(dtype, count, shape=None):
            nonlocal offset
            a = np.frombuffer(buf, dtype=dtype, count=count, offset=offset)
            offset += a.nbytes
            return a.reshape(shape) if shape else a

        self.keys = array(np.uint8, n * KEY_BYTES, (n, KEY_BYTES))
        self.home = array(np.int64, n)
        self.state = array(np.int64, n)
        self.version = array(np.int64, n)
        self.stamp = array(np.int64, n)
        self.wtime = array(np.float64, n)
        self.table = array(np.int64, m)

    def initialize(self) -> None:
        """A new region (zeroed): every slot free, the table empty."""
        self.stamp[:] = -1
        self.table[:] = -1

    def close(self) -> None:
        """Drop the views (the mapping can then be unmapped)."""
        for name in ("keys", "home", "state", "version", "stamp", "wtime", "table", "header"):
            setattr(self, name, None)

    # ---- lookups -------------------------------------------------------------------------------
    def find(self, key: bytes) -> int:
        """The slot holding `key` (any state), or -1."""
        home = key_home(key)
        pos = home & self.mask
        table, keys = self.table, self.keys
        while True:
            slot = int(table[pos])
            if slot < 0:
                return -1
            if keys[slot].tobytes() == key:
                return slot
            pos = (pos + 1) & self.mask

    def find_ready(self, key: bytes, touch: bool = True) -> tuple[int, int]:
        """(slot, version) of `key` if READY (touching its LRU stamp), else (-1, 0)."""
        slot = self.find(key)
        if slot < 0 or self.state[slot] != READY:
            return -1, 0
        if touch:
            self.touch(slot)
        return slot, int(self.version[slot])

    def valid(self, slot: int, version: int) -> bool:
        return self.state[slot] == READY and self.version[slot] == version

    def touch(self, slot: int) -> None:
        clock = int(self.header[self.clock_word])
        self.stamp[slot] = clock
        self.header[self.clock_word] = clock + 1

    def num_ready(self) -> int:
        return int(np.count_nonzero(self.state == READY))

    # ---- writes --------------------------------------------------------------------------------
    def reserve(self, key: bytes, victims: list[int] | None = None) -> tuple[int, int, bytes | None] | None:
        """A slot for `key`, WRITING, with its new version and the key it evicted (None: it was free or not
        READY). None when the key is already here (touched) or every slot is being written. `victims`: slots
        to take, in order (from `victims()`, under the same lock), instead of a search per key."""
        slot = self.find(key)
        if slot >= 0:
            self.touch(slot)
            return None
        now = time.time()
        slot = victims.pop(0) if victims else self._victim(now) if victims is None else -1
        if slot < 0:
            return None
        victim = self.keys[slot].tobytes() if self.state[slot] == READY else None
        if self.state[slot] != FREE:
            self._table_delete(slot)
        self.keys[slot] = np.frombuffer(key, dtype=np.uint8)
        self.home[slot] = key_home(key)
        self.state[slot] = WRITING
        self.version[slot] += 1
        self.wtime[slot] = now
        self.touch(slot)
        self._table_insert(slot)
        return slot, int(self.version[slot]), victim

    def commit(self, slot: int, version: int) -> bool:
        """The writer finished: READY, unless the slot was taken from it meanwhile."""
        if self.version[slot] != version or self.state[slot] != WRITING:
            return False
        self.state[slot] = READY
        return True

    def drop(self, slot: int, version: int) -> None:
        """Free the slot if it still holds that version (a failed write, a corrupted entry)."""
        if self.version[slot] != version or self.state[slot] == FREE:
            return
        self._table_delete(slot)
        self.state[slot] = FREE
        self.stamp[slot] = -1

    def victims(self, count: int) -> list[int]:
        """Up to `count` slots to take, free ones first, then the least recently used, none a live writer holds
        (one partial sort for a whole batch of reservations)."""
        now = time.time()
        stamp = np.where((self.state == WRITING) & (now - self.wtime <= STALE_WRITE_S), _INT64_MAX, self.stamp)
        count = min(count, len(stamp))
        if count <= 0:
            return []
        chosen = np.argpartition(stamp, count - 1)[:count] if count < len(stamp) else np.arange(len(stamp))
        chosen = chosen[np.argsort(stamp[chosen], kind="stable")]
        return [int(s) for s in chosen if stamp[s] != _INT64_MAX]

    def _victim(self, now: float) -> int:
        """A free slot, else the least recently used one that no live writer holds; -1 if none."""
        slot = int(np.argmin(self.stamp))
        if self.state[slot] != WRITING or now - self.wtime[slot] > STALE_WRITE_S:
            return slot
        busy = (self.state == WRITING) & (now - self.wtime <= STALE_WRITE_S)
        masked = np.where(busy, _INT64_MAX, self.stamp)
        slot = int(np.argmin(masked))
        return -1 if masked[slot] == _INT64_MAX else slot

    # ---- the hash table ------------------------------------------------------------------------
    def _table_insert(self, slot: int) -> None:
        pos = int(self.home[slot]) & self.mask
        while self.table[pos] >= 0:
            pos = (pos + 1) & self.mask
        self.table[pos] = slot

    def _table_delete(self, slot: int) -> None:
        mask, table, home = self.mask, self.table, self.home
        pos = int(home[slot]) & mask
        while table[pos] != slot:
            if table[pos] < 0:
                return  # not in the table
            pos = (pos + 1) & mask
        hole, probe = pos, pos
        while True:  # backward shift: move later entries of the run whose home is not in (hole, probe]
            probe = (probe + 1) & mask
            moved = int(table[probe])
            if moved < 0:
                break
            want = int(home[moved]) & mask
            if (hole < probe and hole < want <= probe) or (hole > probe and (want > hole or want <= probe)):
                continue
            table[hole] = moved
            hole = probe
        table[hole] = -1
