"""Hands the C heap's free pages back to the kernel on a timer (glibc `malloc_trim`), so that the
server's RSS follows the memory it uses rather than the high-water mark of every malloc arena.

Why: glibc gives each thread that allocates concurrently an arena of its own (the engine
thread, the tokenizer pool, torch's workers, the metrics renderer), and frees chunks back into
that arena, not to the kernel: only the free top of the main heap is returned by itself. Under
a soak, arenas that served a burst kept 9-24 MiB of free chunks each (`malloc_info`), and RSS
crept up with every burst larger than the last. `malloc_trim(0)` walks every arena and
releases the whole free pages inside them (MADV_DONTNEED); their addresses stay reserved and
come back as zero pages on the next use.

It takes each arena's lock in turn, so it runs on its own thread, every `interval_s`, and its
cost is reported (`everystop:heap_trim_seconds`) beside what it released
(`everystop:heap_trim_released_bytes`, from RSS before and after each call).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily

logger = logging.getLogger(__name__)


def _load_malloc_trim() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    fn = getattr(ctypes.CDLL(name), "malloc_trim", None)  # glibc only (not musl, not macOS)
    if fn is not None:
        fn.argtypes = (ctypes.c_size_t,)
        fn.restype = ctypes.c_int
    return fn


_MALLOC_TRIM = _load_malloc_trim()


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class HeapTrimmer:
    """A daemon thread calling `malloc_trim(0)` every `interval_s`; counts calls, time, bytes."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.calls = 0
        self.seconds = 0.0
        self.released_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return _MALLOC_TRIM is not None

    def trim_once(self) -> int:
        """One trim; returns the bytes RSS fell by (0 when it did not, or without glibc)."""
        if _MALLOC_TRIM is None:
            return 0
        before = _rss_bytes()
        started = time.perf_counter()
        _MALLOC_TRIM(0)
        self.seconds += time.perf_counter() - started
        self.calls += 1
        # NOTE: RSS is the whole process, so another thread's allocation in between can hide
        # part of what was released; clamped at 0, this undercounts, never overcounts.
        released = max(0, before - _rss_bytes())
        self.released_bytes += released
        return released

    def start(self) -> None:
        if self.interval_s <= 0 or _MALLOC_TRIM is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="heap-trim", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.trim_once()
            except Exception:  # never take the server down over an optimisation
                logger.exception("malloc_trim failed; heap trimming stops")
                return

    def metrics(self) -> Iterator[Any]:
        seconds = CounterMetricFamily("everystop:heap_trim_seconds",
                                      "Time spent in malloc_trim (arena locks held)")
        seconds.add_metric([], self.seconds)
        yield seconds
        released = CounterMetricFamily("everystop:heap_trim_released_bytes",
                                       "RSS returned to the kernel by malloc_trim")
        released.add_metric([], self.released_bytes)
        yield released
        calls = CounterMetricFamily("everystop:heap_trim_calls", "malloc_trim calls")
        calls.add_metric([], self.calls)
        yield calls


# One per process (the C heap is): started by the server, read by its /metrics.
HEAP_TRIMMER = HeapTrimmer(0.0)


def start_heap_trimming(interval_s: float) -> None:
    """Trim once now, then every `interval_s` seconds (0: never).

    The first trim returns what start-up freed (the weights' staging buffers, the cost probes'
    and warm-up passes' activations) before the first request, rather than `interval_s` into
    serving (the 1B-shape Q8_0 engine built offline: 1,610 -> 1,567 MiB RSS)."""
    HEAP_TRIMMER.interval_s = interval_s
    if interval_s > 0:
        released = HEAP_TRIMMER.trim_once()
        logger.info("start-up heap trim: %.1f MiB returned to the kernel", released / 2**20)
    HEAP_TRIMMER.start()
