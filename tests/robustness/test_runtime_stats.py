"""The server's view of its own process: full GC pauses are timed and start-up objects frozen
out of them (they stopped /health for ~170 ms each), and the KV pools' resident pages are
counted so a soak can tell first touch from growth; the C heap's free pages are handed back."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

import torch

from everystop.executor.kv_pool import KVPool
from everystop.executor.residency import pool_resident_bytes, resident_bytes
from everystop.server.heap_trim import HeapTrimmer
from everystop.server.runtime_stats import (
    _PAUSES,
    freeze_startup_heap,
    gc_pause_metrics,
    install_gc_pause_recorder,
)

MIB = 1 << 20


def test_full_collections_are_timed_by_generation() -> None:
    install_gc_pause_recorder()
    install_gc_pause_recorder()  # idempotent: one callback, each pause counted once
    assert gc.callbacks.count(_PAUSES.callback) == 1
    # Automatic collections off meanwhile: one that an allocation (here or on a thread an
    # earlier test left running) set off would be counted too.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        before = sum(_PAUSES.counts[2])
        gc.collect()
        gc.collect()
        assert sum(_PAUSES.counts[2]) == before + 2 and _PAUSES.sums[2] > 0
        frozen_before = gc.get_freeze_count()
        [hist, frozen] = list(gc_pause_metrics())
    finally:
        if was_enabled:
            gc.enable()
    samples = {(s.name, s.labels.get("generation"), s.labels.get("le")): s.value
               for s in hist.samples}
    assert samples[("everystop:gc_pause_seconds_count", "2", None)] == before + 2
    assert samples[("everystop:gc_pause_seconds_bucket", "2", "+Inf")] == before + 2
    # Meanwhile another thread may freeze objects and frozen objects may die by refcount
    # (tests/conftest.py freezes what outlives each test), so the sample is held near the
    # counts read before and after it rather than between them.
    frozen_after = gc.get_freeze_count()
    slack = 100 + max(frozen_before, frozen_after) // 1000
    assert (min(frozen_before, frozen_after) - slack <= frozen.samples[0].value
            <= max(frozen_before, frozen_after) + slack)


def test_freezing_takes_the_live_heap_out_of_full_collections() -> None:
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 10_000  # torch, the server stack, pytest
        assert len(gc.get_objects()) < gc.get_freeze_count() // 2
    finally:
        gc.unfreeze()


def test_pool_pages_count_as_resident_only_once_written() -> None:
    # Each pool above glibc's largest mmap threshold (32 MiB), so it is always a fresh mapping:
    # a smaller one can come from heap pages an earlier test already touched (it failed so in
    # CI, under xdist, with 32 + 16 MiB).
    pool = KVPool(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16,
                  num_device_blocks=2048, num_host_blocks=1536, dtype=torch.float32,
                  device=torch.device("cpu"))
    # 64 MiB device + 48 MiB host, untouched: at most a few pages (a huge page at an edge).
    untouched = pool_resident_bytes(pool)
    assert untouched is not None and untouched <= 4 * MIB
    pool.device_pool[:, :, :1024] = 1.0  # half of every layer's blocks
    half = pool_resident_bytes(pool)
    assert half is not None and 32 * MIB <= half - untouched <= 32 * MIB + 8 * MIB
    pool.host_pool.fill_(0.0)
    assert pool_resident_bytes(pool) >= half + 48 * MIB - 8 * MIB  # type: ignore[operator]
    data = torch.ones(MIB // 4)  # 1 MiB, written: resident
    assert resident_bytes(data.data_ptr(), MIB) >= MIB  # type: ignore[operator]



def test_heap_trim_hands_freed_heap_pages_back() -> None:
    # 64 MiB in 64 KiB chunks (below glibc's mmap threshold: heap, not mappings), written, then
    # freed except one chunk above them, so they are not the heap's free top that free() itself
    # returns: only malloc_trim gives those pages back.
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    trimmer = HeapTrimmer(0.0)
    assert trimmer.available  # glibc on Linux: the platform the server runs on
    trimmer.trim_once()
    chunks = [libc.malloc(64 << 10) for _ in range(1024)]
    pin = libc.malloc(64 << 10)
    for c in chunks:
        ctypes.memset(c, 1, 64 << 10)
    for c in chunks:
        libc.free(c)
    released = trimmer.trim_once()
    libc.free(pin)
    assert released >= 32 * MIB, released
    names = {m.name: m.samples[0].value for m in trimmer.metrics()}
    assert names["everystop:heap_trim_calls"] == 2
    assert names["everystop:heap_trim_released_bytes"] == trimmer.released_bytes >= released
    assert names["everystop:heap_trim_seconds"] > 0


def test_start_heap_trimming_trims_once_at_start_up(monkeypatch) -> None:
    from everystop.server import heap_trim

    trimmer = HeapTrimmer(0.0)
    monkeypatch.setattr(heap_trim, "HEAP_TRIMMER", trimmer)
    heap_trim.start_heap_trimming(0.0)  # 0: never, not even at start-up
    assert trimmer.calls == 0
    heap_trim.start_heap_trimming(3600.0)
    try:
        assert trimmer.calls == 1  # before serving, not an interval into it
    finally:
        trimmer.stop()
