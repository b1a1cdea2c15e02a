"""DiskFiles: the disk tier's bytes, one file per slot of its index (index.py), in `disk_path/<region name>/`.

A file is a header then one block's bytes over all layers (the RAM tier's slot, as it was evicted):
    b"PLKVBLK1" | key (40 bytes: block hash, tensor-parallel rank) | uint32 CRC-32 of the data | uint64 length
Written to a temporary name and renamed, so a reader sees the old file or the new one, never half of one; a
reader checks magic, key, length and CRC: a file that is missing, truncated, or corrupted on disk reads as None
(the connector reports the block's load failed and the scheduler recomputes it). The directory belongs to the
region: its last user removes it (region.py's on_last).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import zlib

from pagedllm.kv_transfer.offloading.index import KEY_BYTES

MAGIC = b"PLKVBLK1"
_HEADER = struct.Struct(f"<8s{KEY_BYTES}sIQ")


class DiskFiles:
    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)

    def path(self, slot: int) -> str:
        return os.path.join(self.directory, f"{slot:08d}.kvblock")

    def write(self, slot: int, key: bytes, data: memoryview) -> None:
        path = self.path(slot)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(MAGIC, key, zlib.crc32(data), len(data)))
                f.write(data)
            os.replace(tmp, path)
        except OSError:  # disk full, directory removed: the block is not spilled
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def read(self, slot: int, key: bytes, out: memoryview) -> bool:
        """Fill `out` (one slot's bytes) from the slot's file; False if it is missing or does not check out."""
        try:
            with open(self.path(slot), "rb") as f:
                header = f.read(_HEADER.size)
                if len(header) != _HEADER.size:
                    return False
                magic, file_key, crc, length = _HEADER.unpack(header)
                if magic != MAGIC or file_key != key or length != len(out):
                    return False
                if f.readinto(out) != length or f.read(1):
                    return False
        except OSError:
            return False
        return zlib.crc32(out) == crc

    def remove(self, slot: int) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path(slot))

    def remove_all(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
