"""What the interpreter knows about the server process that its own counters do not: how long
garbage-collector pauses stop every thread (the event loop included).

GC pauses: a full (generation 2) collection walks every tracked object and holds the GIL while
it does; with the model, tokenizer and web stack loaded (~226k objects) one took ~170 ms on an
idle core, longer on a shared one, and /health waits for it like everything else.
`freeze_startup_heap` moves everything alive at start-up out of the collector's reach (a full
collection then took ~1 ms); `gc_pause_metrics` reports the pauses that remain.
"""

from __future__ import annotations

import gc
import time
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

GC_PAUSE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_TRACKED_GENERATIONS = (1, 2)  # generation 0 runs every ~700 allocations and takes microseconds


class _GcPauses:
    """Per generation: bucket counts and the sum of pause seconds, since the process started.

    NOTE: updated from inside the collector's callback with plain list arithmetic, no lock:
    the callback runs with the GIL held and a collection never starts inside another one, while
    a lock taken here could already be held by the thread the collection interrupted."""

    def __init__(self) -> None:
        self.counts = {g: [0] * (len(GC_PAUSE_BUCKETS) + 1) for g in _TRACKED_GENERATIONS}
        self.sums = {g: 0.0 for g in _TRACKED_GENERATIONS}
        self._started = 0.0
        self.installed = False

    def callback(self, phase: str, info: dict[str, Any]) -> None:
        generation = info["generation"]
        if generation not in self.counts:
            return
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        self.counts[generation][bisect_left(GC_PAUSE_BUCKETS, pause)] += 1
        self.sums[generation] += pause


_PAUSES = _GcPauses()


def install_gc_pause_recorder() -> None:
    """Start timing collections (once per process; later calls do nothing)."""
    if not _PAUSES.installed:
        _PAUSES.installed = True
        gc.callbacks.append(_PAUSES.callback)


def freeze_startup_heap() -> None:
    """Collect once, then move every surviving object to the permanent generation, so that
    later full collections walk only what serving allocated (start-up objects, the model's
    modules, the tokenizer and the imported libraries, live for the whole process anyway)."""
    gc.collect()
    gc.freeze()


def gc_pause_metrics() -> Iterator[Any]:
    """`everystop:gc_pause_seconds{generation}` (a histogram) and the frozen object count."""
    hist = HistogramMetricFamily("everystop:gc_pause_seconds",
                                 "Garbage-collector pauses (every thread waits), by generation",
                                 labels=["generation"])
    for generation, counts in _PAUSES.counts.items():
        cumulative, buckets = 0, []
        for bound, count in zip((*GC_PAUSE_BUCKETS, float("inf")), counts):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
        hist.add_metric([str(generation)], buckets, _PAUSES.sums[generation])
    yield hist
    yield GaugeMetricFamily("everystop:gc_frozen_objects",
                            "Objects moved out of the collector's reach at start-up",
                            value=gc.get_freeze_count())
