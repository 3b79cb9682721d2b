"""Event-loop lag: how late the loop wakes a task that asked to sleep. Every coroutine on the
loop (each stream, /health) is late by as much, so this is the stall clients feel when work runs
on the loop; the engine's watchdog, on its own thread, cannot see it.

`LoopLagMonitor` samples it every `interval_s` and hands each sample to its observers (the
Prometheus histogram `everystop:event_loop_lag_seconds` and the guardrails' loop_lag alert).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

logger = logging.getLogger("everystop.server")


class LoopLagMonitor:
    def __init__(self, observers: list[Callable[[float], None]],
                 interval_s: float = 0.1) -> None:
        """`observers`: called on the loop with each lag sample, in seconds (read at each
        sample, so one added later is fed too)."""
        if not interval_s > 0:
            raise ValueError("interval_s must be > 0")
        self.observers = observers
        self.interval_s = interval_s
        self.max_lag_s = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start sampling on the running loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name="everystop-loop-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, loop.time() - start - self.interval_s)
            self.max_lag_s = max(self.max_lag_s, lag)
            for observe in self.observers:
                try:
                    observe(lag)
                except Exception:  # a bad observer must not stop the sampling
                    logger.exception("loop-lag observer failed")
