"""Moves telemetry off the hot path: a bounded queue drained by one writer thread.

`submit()` never blocks and never does I/O: when the queue is full (a slow or stuck database)
the item is dropped and counted, so the scheduler's step time cannot depend on the store.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from everystop.telemetry.rows import Row
from everystop.telemetry.store import Store

logger = logging.getLogger("everystop.telemetry")

Prepare = Callable[[list[Any]], list[Row]]


class TelemetryWriter:
    """Args:
        store: where rows go (used only from the writer thread).
        max_queue: items held before new ones are dropped.
        batch_size: most items written in one transaction.
        prepare: turns a batch of submitted items into rows, on the writer thread (so
            aggregation such as per-token timing stays off the engine thread too). Without it,
            items must already be rows.
    """

    def __init__(self, store: Store, *, max_queue: int = 10_000, batch_size: int = 512,
                 prepare: Prepare | None = None) -> None:
        self.store = store
        self.batch_size = batch_size
        self.prepare = prepare
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._stop = threading.Event()
        # Plain counters read by scrapes; `_count_lock` because several threads submit.
        self._count_lock = threading.Lock()
        self.submitted: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.written: Counter[str] = Counter()  # rows, by table
        self.num_write_errors = 0
        self._thread = threading.Thread(target=self._run, name="everystop-telemetry",
                                        daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def max_queue(self) -> int:
        return self._queue.maxsize

    def submit(self, item: Any) -> bool:
        """Enqueue without waiting; False (and counted) when the queue is full or closed."""
        kind = type(item).__name__
        try:
            if self._stop.is_set():
                raise queue.Full
            self._queue.put_nowait(item)
        except queue.Full:
            with self._count_lock:
                self.dropped[kind] += 1
            return False
        with self._count_lock:
            self.submitted[kind] += 1
        return True

    def _run(self) -> None:
        while True:
            try:
                first = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            batch = [first]
            while len(batch) < self.batch_size:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._write(batch)
            for _ in batch:
                self._queue.task_done()

    def _write(self, batch: list[Any]) -> None:
        try:
            rows = self.prepare(batch) if self.prepare else batch
            if rows:
                self.store.insert(rows)
                for row in rows:
                    self.written[row.table] += 1
        except Exception:  # a store outage loses this batch, never the writer thread
            self.num_write_errors += 1
            logger.exception("telemetry write failed (%d items lost)", len(batch))

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything submitted so far is written (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting, write what is queued (up to timeout), stop the thread."""
        self.flush(timeout)
        self._stop.set()
        self._thread.join(timeout)
