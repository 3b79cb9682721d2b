"""How many bytes of the KV pools are resident in this process's memory.

The pools are allocated uninitialised, so their pages become resident as blocks are first
written; `resident_bytes` (mincore) tells that first touch apart from growth.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

from everystop.executor.kv_pool import KVPool

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _load_mincore() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    fn = getattr(libc, "mincore", None)
    if fn is not None:
        fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
        fn.restype = ctypes.c_int
    return fn


_MINCORE = _load_mincore()


def resident_bytes(address: int, nbytes: int) -> int | None:
    """Bytes of the pages covering [address, address + nbytes) that are in memory (mincore);
    None where mincore is unavailable or refuses the range."""
    if _MINCORE is None or nbytes <= 0:
        return None
    start = address - address % _PAGE
    pages = (address + nbytes - start + _PAGE - 1) // _PAGE
    vec = (ctypes.c_ubyte * pages)()
    if _MINCORE(start, pages * _PAGE, vec) != 0:
        return None
    # The low bit of each byte says whether that page is resident (the others are reserved).
    return bytes(vec).translate(_LOW_BIT).count(1) * _PAGE


_LOW_BIT = bytes(b & 1 for b in range(256))


def pool_resident_bytes(pool: KVPool) -> int | None:
    """The device pool (when it lives in host memory) and the host swap pool, by mincore;
    None where mincore cannot tell."""
    total = 0
    for tensor in (pool.device_pool, pool.host_pool):
        if tensor.device.type != "cpu":
            continue
        resident = resident_bytes(tensor.data_ptr(), tensor.numel() * tensor.element_size())
        if resident is None:
            return None
        total += resident
    return total
