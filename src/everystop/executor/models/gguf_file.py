"""A GGUF file's metadata and tensor table, read in one pass that skips what loading does not
need (the tokenizer's vocabulary and merges: 100k strings the `gguf` package's reader turns
into numpy objects one by one, seconds of start-up). Tensor data stays in a read-only mapping of
the file; `release(tensor)` drops a tensor's pages from this process's resident memory once the
loader holds its own copy, so loading never holds the file and the model in memory at once.

Layout (GGUF v2/v3, little-endian): magic "GGUF", version u32, tensor count u64, metadata
count u64; metadata as (key, type u32, value); tensor infos as (name, n_dims u32,
dims u64[n_dims] innermost first, type u32, offset u64); data from the next multiple of
`general.alignment` (32 by default).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

# value type -> struct format of a scalar (8 = string, 9 = array are handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# Tensor types numpy can view directly; everything else is quantized blocks (bytes).
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32,
          27: np.int64, 28: np.float64}


@dataclass
class GGUFTensor:
    name: str
    shape: list[int]  # GGUF order: innermost dimension first
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # plain types: values, rows outermost; quantized: uint8 [rows, bytes]
    offset: int = 0  # where its bytes (data.nbytes of them) start in the file


class GGUFFile:
    def __init__(self, path: str, skip_prefix: str = "tokenizer.ggml.") -> None:
        """Metadata whose key starts with `skip_prefix` is skipped, except `*_id` scalars."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._buf = memoryview(self._map)
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        self._pos = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            vtype = self._u32()
            skip = key.startswith(skip_prefix) and not key.endswith("_id")
            value = self._value(vtype, skip)
            if not skip:
                self.fields[key] = value
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._u32()
            dims = list(struct.unpack_from(f"<{n_dims}Q", buf, self._pos))
            self._pos += 8 * n_dims
            ttype, offset = struct.unpack_from("<IQ", buf, self._pos)
            self._pos += 12
            infos.append((name, dims, ttype, offset))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, dims, ttype, offset in infos:
            qtype = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims))
            rows = tuple(reversed(dims))
            begin = start + offset
            if ttype in _PLAIN:
                data = np.frombuffer(buf, _PLAIN[ttype], n, begin).reshape(rows)
            else:
                row_bytes = dims[0] // block * type_size
                data = np.frombuffer(buf, np.uint8, n // block * type_size,
                                     begin).reshape(*rows[:-1], row_bytes)
            self.tensors.append(GGUFTensor(name, dims, qtype, data, begin))

    def release(self, tensor: GGUFTensor) -> None:
        """Drop the whole pages inside `tensor`'s bytes from this process's resident set (the
        mapping is read-only and shared, so nothing is lost: a later read faults them back from
        the page cache or the file). A no-op where madvise is unavailable."""
        page = mmap.PAGESIZE
        start = -(-tensor.offset // page) * page
        end = (tensor.offset + tensor.data.nbytes) // page * page
        if end > start and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _u32(self) -> int:
        (v,) = struct.unpack_from("<I", self._buf, self._pos)
        self._pos += 4
        return int(v)

    def _u64(self) -> int:
        (v,) = struct.unpack_from("<Q", self._buf, self._pos)
        self._pos += 8
        return int(v)

    def _string(self) -> str:
        n = self._u64()
        s = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: int, skip: bool) -> Any:
        if vtype == _STRING:
            if skip:
                n = self._u64()  # NOTE: not `self._pos += self._u64()`: _u64 moves _pos
                self._pos += n
                return None
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._u32(), self._u64()
            if etype in _SCALARS and skip:
                self._pos += count * struct.calcsize(_SCALARS[etype])
                return None
            return [self._value(etype, skip) for _ in range(count)]
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise ValueError(f"unknown GGUF value type {vtype}")
        (v,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return v
