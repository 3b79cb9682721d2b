"""One engine's telemetry, assembled: store, writer, recorder, guardrails and their monitor."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from everystop.core.observed_engine import ObservedEngine
from everystop.telemetry.alerts import (
    Alert,
    GuardrailConfig,
    Guardrails,
    clamp_change,
    register_alert_metrics,
)
from everystop.telemetry.recorder import TelemetryRecorder
from everystop.telemetry.store import Store, open_store

logger = logging.getLogger("everystop.telemetry")


class Telemetry:
    """Args:
        store: an open Store (see `open_store`), or None for guardrails and metrics only.
        engine: the engine to observe: an AsyncEngine, or an LLMEngine driven on this thread.
        monitor: run the guardrail checks on a thread of their own every check_interval_s
            (needs an AsyncEngine, whose `inspect` takes the engine lock); without it the
            caller runs `check_now()` on the engine's own thread.
    """

    def __init__(self, store: Store | None, engine: ObservedEngine, *, monitor: bool = False,
                 guardrail_config: GuardrailConfig | None = None, model_version: str = "unknown",
                 max_queue: int = 10_000) -> None:
        self.store = store
        self.engine = engine
        self.guardrails = Guardrails(guardrail_config)
        # Applies a guardrail's config change (changes, reason). The admin API sets its own, so
        # the change is versioned and persisted; by default it is applied here and logged.
        self.clamp_sink: Callable[[dict[str, int], str], Any] = self._apply_clamp
        self.recorder: TelemetryRecorder | None = None
        if store is not None:
            self.recorder = TelemetryRecorder(
                store, block_size=engine.block_size, clock=engine.clock,
                guardrails=self.guardrails, model_version=model_version, max_queue=max_queue)
            self.recorder.attach(engine)
        else:  # no store: still feed the guardrails
            engine.add_listeners(self._on_iteration, self._on_finish)
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        if monitor:
            self._monitor = threading.Thread(target=self._run_monitor, daemon=True,
                                             name="everystop-guardrails")
            self._monitor.start()

    @property
    def writer(self) -> Any:
        return None if self.recorder is None else self.recorder.writer

    def _on_iteration(self, record: Any, sched: Any) -> None:
        self.guardrails.on_iteration(record, self.engine.scheduler_config.max_num_batched_tokens)

    def _on_finish(self, req: Any, out: Any) -> None:
        self.guardrails.on_finish(req)

    def register_metrics(self, registry: Any) -> Any:
        return register_alert_metrics(registry, self.guardrails, self.writer)

    def check_now(self) -> list[Alert]:
        """Run the guardrail checks, then log and store what they raised (outside the lock)."""
        self.engine.inspect(lambda sched: self.guardrails.check(sched, self.engine.clock()))
        alerts = self.guardrails.drain()
        for alert in alerts:
            logger.warning("guardrail %s: %s", alert.kind, alert.message)
            if self.recorder is not None:
                self.recorder.submit_alert(alert)
        for cap, reason in self.guardrails.drain_clamps():
            changes = clamp_change(self.engine.scheduler_config, cap)
            if changes is not None:
                logger.warning("guardrail auto-clamp (%s): %s", reason, changes)
                self.clamp_sink(changes, reason)
        return alerts

    def _apply_clamp(self, changes: dict[str, int], reason: str) -> None:
        engine = self.engine
        engine.update_config(engine.scheduler_config.replace(**changes), engine.cache_config)

    def _run_monitor(self) -> None:
        while not self._stop.wait(self.guardrails.config.check_interval_s):
            try:
                self.check_now()
            except Exception:
                logger.exception("guardrail check failed")

    def close(self) -> None:
        """Stop the monitor, write what is queued, close the store."""
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=5)
        if self.recorder is not None:
            self.recorder.detach()
            self.recorder.writer.close()
        else:
            self.engine.remove_listeners(self._on_iteration, self._on_finish)
        if self.store is not None:
            self.store.close()


def open_telemetry(db: str | None, engine: ObservedEngine, **kwargs: Any) -> Telemetry:
    """Telemetry for an engine; `db` is a SQLite path or a postgresql:// DSN (None: no store)."""
    return Telemetry(open_store(db) if db else None, engine, **kwargs)
