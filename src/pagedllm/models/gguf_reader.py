"""A small GGUF reader: header, metadata and tensor index parsed with `struct` over a read-only memory map;
tensor data as zero-copy uint8 views of the same map.

It replaces gguf's GGUFReader on the load path: that one builds a numpy view per metadata item and takes
several seconds on the 49k token strings of a Llama vocabulary; this one takes tens of milliseconds.

Layout (GGUF v2/v3, little-endian; ggml/docs/gguf.md):
    magic b"GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x (key: string, value_type u32, value)          string = u64 length + UTF-8 bytes
    tensor_count x (name: string, n_dims u32, dims u64 x n_dims, ggml_type u32, offset u64)
    padding to `general.alignment` (default 32), then the tensor data; each offset is from there.
An array value is (element_type u32, count u64, elements).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from pagedllm.math_utils import cdiv

_STRING, _ARRAY = 8, 9
# fixed-size value types: u8, i8, u16, i16, u32, i32, f32, bool, u64, i64, f64
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
                   11: "<q", 12: "<d"}
_NUMPY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
                 11: "<i8", 12: "<f8"}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class GGUFFormatError(ValueError):
    """The bytes do not form a GGUF file this reader understands (corrupt, truncated or unsupported)."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # ggml order (fastest-varying dimension first), as gguf.ReaderTensor.shape
    data: np.ndarray  # [nbytes] uint8, a read-only view of the file map


class GGUFFile:
    """Everything in a GGUF file but the tensor bytes, which stay in the memory map until read.

    Attributes:
        metadata: key -> value (int, float, bool, str, or a list of those for arrays).
        tensors: in file order.
    """

    def __init__(self, path: str | Path):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != b"GGUF":
            raise GGUFFormatError(f"not a GGUF file (magic {bytes(buf[:4])!r})")
        self._buf, self._pos = buf, 4
        self.version = self._u32()
        if self.version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {self.version} is not supported (2 or 3; big-endian files "
                                  "are not supported)")
        num_tensors, num_kv = self._u64(), self._u64()
        # Every kv pair takes at least 12 bytes and every tensor info at least 24: reject absurd counts
        # before looping over them.
        if num_kv * 12 + num_tensors * 24 > len(buf):
            raise GGUFFormatError(f"header claims {num_tensors} tensors and {num_kv} metadata keys, more "
                                  f"than a {len(buf)}-byte file can hold")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = self._string()
            self.metadata[key] = self._value(self._u32())
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = self.metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0:
            raise GGUFFormatError(f"general.alignment must be a positive integer, got {alignment!r}")
        self.data_offset = cdiv(self._pos, alignment) * alignment
        self.tensors = [self._tensor(*info) for info in infos]

    # ---- primitives ------------------------------------------------------------------------------
    def _take(self, n: int) -> int:
        start, self._pos = self._pos, self._pos + n
        if self._pos > len(self._buf):
            raise GGUFFormatError(f"file ends inside the header (needed byte {self._pos}, file has "
                                  f"{len(self._buf)})")
        return start

    def _u32(self) -> int:
        return _U32.unpack_from(self._buf, self._take(4))[0]

    def _u64(self) -> int:
        return _U64.unpack_from(self._buf, self._take(8))[0]

    def _string(self) -> str:
        n = self._u64()
        start = self._take(n)
        return self._buf[start:start + n].decode("utf-8")

    def _strings(self, count: int) -> list[str]:
        # The hot loop of the reader (a vocabulary is ~50k strings): inlined, no helper calls.
        buf, pos, end, unpack = self._buf, self._pos, len(self._buf), _U64.unpack_from
        out = []
        for _ in range(count):
            if pos + 8 > end:
                raise GGUFFormatError("file ends inside a string array")
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > end:
                raise GGUFFormatError("file ends inside a string array")
            out.append(buf[pos:pos + n].decode("utf-8"))
            pos += n
        self._pos = pos
        return out

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            element_type, count = self._u32(), self._u64()
            if element_type in _NUMPY_DTYPES:
                dtype = np.dtype(_NUMPY_DTYPES[element_type])
                start = self._take(count * dtype.itemsize)
                return np.frombuffer(self._buf, dtype, count, start).tolist()
            if count > len(self._buf):
                raise GGUFFormatError(f"array of {count} elements in a {len(self._buf)}-byte file")
            if element_type == _STRING:
                return self._strings(count)
            return [self._value(element_type) for _ in range(count)]
        fmt = _SCALAR_FORMATS.get(value_type)
        if fmt is None:
            raise GGUFFormatError(f"unknown metadata value type {value_type}")
        return struct.unpack_from(fmt, self._buf, self._take(struct.calcsize(fmt)))[0]

    def _tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self._string()
        num_dims = self._u32()
        if num_dims > 8:
            raise GGUFFormatError(f"tensor {name!r} has {num_dims} dimensions")
        dims = [self._u64() for _ in range(num_dims)]
        return name, dims, self._u32(), self._u64()

    def _tensor(self, name: str, dims: list[int], type_id: int, offset: int) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFFormatError(f"tensor {name!r} has unknown ggml type {type_id}") from None
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        num_elements = int(np.prod(dims, dtype=np.float64))  # float: no overflow on absurd dims
        if num_elements > len(self._buf) * block_size or num_elements % block_size:
            raise GGUFFormatError(f"tensor {name!r} ({qtype.name}) has an impossible shape {dims}")
        nbytes = num_elements // block_size * type_size
        start = self.data_offset + offset
        if start + nbytes > len(self._buf):
            raise GGUFFormatError(f"tensor {name!r} ends at byte {start + nbytes} but the file has "
                                  f"{len(self._buf)}: the file is truncated")
        data = np.frombuffer(self._buf, np.uint8, nbytes, start)
        return GGUFTensor(name, qtype, np.array(dims, dtype=np.uint64), data)
