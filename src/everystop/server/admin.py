"""Operator controls: hot-reloadable scheduler config, and telemetry wiring for the app.

  GET   /admin/scheduler_config          the config in force and its version
  PATCH /admin/scheduler_config          change some of ADJUSTABLE; validated like start-up
                                         (bad values: 400, nothing changes); applied under the
                                         engine lock, so the next iteration uses it; every
                                         version is persisted in the telemetry store
  GET   /admin/scheduler_config/history  the persisted versions (needs a store)

Who may call them (the admin key, else the API key, else loopback clients only):
server/access.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from everystop.config import CacheConfig, ConfigError, SchedulerConfig
from everystop.engine.client import EngineAdmin
from everystop.server.errors import APIError
from everystop.server.limits import loads
from everystop.telemetry.alerts import GuardrailConfig
from everystop.telemetry.rows import ConfigRow
from everystop.telemetry.service import Telemetry, open_telemetry
from everystop.telemetry.store import Store

logger = logging.getLogger("everystop.server")

# Knobs an operator may turn at runtime. Others (max_model_len, scheduling mode...) shape
# admitted requests' contracts and need a restart.
SCHEDULER_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "chunk_size",
                   "max_queued_per_tenant", "max_queued_per_tier", "tpot_target_ms",
                   "tpot_target_ms_per_tier")
ADJUSTABLE = SCHEDULER_KNOBS + ("watermark",)
# Upper bounds on what a PATCH may set: far above any real deployment, low enough that a typo
# (max_num_seqs=1e9) cannot size queues or budgets into absurdity.
CEILINGS = {"max_num_seqs": 1 << 16, "max_num_batched_tokens": 1 << 24, "chunk_size": 1 << 24,
            "max_queued_per_tenant": 1 << 20, "max_queued_per_tier": 1 << 20,
            "tpot_target_ms": 1e6, "tpot_target_ms_per_tier": 1e6, "watermark": 1.0}


class _Invalid(Exception):
    def __init__(self, message: str, param: str | None, status: int = 400,
                 err_type: str = "invalid_request_error", code: str = "invalid_value") -> None:
        super().__init__(message)
        self.status, self.param, self.err_type, self.code = status, param, err_type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.err_type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# What a refused admin change raises (the cluster ingress relays its status and body).
AdminError = _Invalid


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _check_type(name: str, value: Any) -> Any:
    if name == "tpot_target_ms":  # null: derived from the machine; 0: off
        if value is not None and not _is_number(value):
            raise _Invalid("tpot_target_ms must be a number of ms, 0 (off) or null", name)
        return None if value is None else float(value)
    if name == "tpot_target_ms_per_tier":
        if (not isinstance(value, list) or len(value) != 3
                or any(v is not None and not _is_number(v) for v in value)):
            raise _Invalid("tpot_target_ms_per_tier takes a list of three numbers or nulls", name)
        return tuple(None if v is None else float(v) for v in value)
    if name == "watermark":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Invalid("watermark must be a number", name)
        return float(value)
    if name == "max_queued_per_tier":
        if (not isinstance(value, list) or len(value) != 3
                or any(isinstance(v, bool) or not isinstance(v, int) for v in value)):
            raise _Invalid("max_queued_per_tier takes a list of three integers", name)
        return tuple(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid(f"{name} must be an integer", name)
    return value


def _check_bounds(name: str, value: Any) -> Any:
    ceiling = CEILINGS[name]
    for v in value if isinstance(value, tuple) else (value,):
        if v is not None and v > ceiling:
            raise _Invalid(f"{name} must be <= {ceiling:g}", name)
    return value


class SchedulerConfigAdmin:
    """Validates, applies and records scheduler-config versions for one engine in this process."""

    def __init__(self, async_engine: EngineAdmin, *, store: Store | None = None) -> None:
        self.async_engine = async_engine
        self.store = store
        self.version = 1
        self.updated_at = time.time()
        # Versions are validated, persisted and applied one at a time, whether an operator
        # (PATCH, via a worker thread) or a guardrail (its monitor thread) asks.
        self._commit_lock = threading.Lock()
        if store is not None:
            store.insert_config(self._row("startup"))

    def snapshot(self) -> dict[str, Any]:
        front = self.async_engine
        config = dataclasses.asdict(front.scheduler_config)
        config["max_queued_per_tier"] = list(config["max_queued_per_tier"])
        config["watermark"] = front.cache_config.watermark
        return {"object": "scheduler_config", "version": self.version,
                "updated_at": self.updated_at, "adjustable": list(ADJUSTABLE), "config": config}

    def validate(self, body: Any) -> tuple[SchedulerConfig, CacheConfig]:
        """The new configs, or _Invalid. Same invariants as start-up, plus: no request already
        queued may become impossible to admit."""
        if not isinstance(body, dict) or not body:
            raise _Invalid("the body must be a JSON object with at least one of: "
                           + ", ".join(ADJUSTABLE), None)
        for name in body:
            if name not in ADJUSTABLE:
                raise _Invalid(f"{name!r} cannot be changed at runtime (adjustable: "
                               f"{', '.join(ADJUSTABLE)})", name, code="unsupported_parameter")
        values = {name: _check_bounds(name, _check_type(name, value))
                  for name, value in body.items()}
        front = self.async_engine
        sched_changes = {k: v for k, v in values.items() if k in SCHEDULER_KNOBS}
        try:
            new_sched = front.scheduler_config.replace(**sched_changes)
            new_cache = dataclasses.replace(front.cache_config,
                                            watermark=values.get("watermark",
                                                                 front.cache_config.watermark))
        except ConfigError as exc:
            msg = str(exc)
            param = next((k for k in values if k in msg), next(iter(values)))
            raise _Invalid(msg, param) from None
        if "watermark" in values:
            try:
                front.check_cache_config(new_cache)
            except ConfigError as exc:
                raise _Invalid(str(exc), "watermark") from None
        return new_sched, new_cache

    def apply(self, new_sched: SchedulerConfig, new_cache: CacheConfig) -> int:
        """Swap the configs in; returns the engine step count at the switch (iterations
        scheduled after it use the new values)."""
        return self.async_engine.update_config(new_sched, new_cache)

    def _row(self, source: str, sched: SchedulerConfig | None = None,
             cache: CacheConfig | None = None) -> ConfigRow:
        sched = sched or self.async_engine.scheduler_config
        cache = cache or self.async_engine.cache_config
        full = dataclasses.asdict(sched)
        full["watermark"] = cache.watermark
        return ConfigRow(
            version=self.version, max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens, chunk_size=sched.chunk_size,
            gpu_memory_utilization=cache.gpu_memory_utilization,
            kv_watermark_pct=cache.watermark, max_queued_per_tenant=sched.max_queued_per_tenant,
            max_queued_per_tier=",".join(str(v) for v in sched.max_queued_per_tier),
            source=source, config_json=json.dumps(full, sort_keys=True),
            updated_at=time.time())

    def commit(self, body: Any, source: str = "admin") -> dict[str, Any]:
        """Validate, persist, then apply one change (blocking: store I/O); `source` is recorded
        in the history ("admin", "guardrail")."""
        with self._commit_lock:
            new_sched, new_cache = self.validate(body)
            self.version += 1
            row = self._row(source, new_sched, new_cache)
            if self.store is not None:
                try:  # persist first: a version that cannot be recorded is not applied
                    self.store.insert_config(row)
                except Exception as exc:
                    self.version -= 1
                    logger.exception("could not persist scheduler config")
                    raise _Invalid(f"could not record the new config: {exc}", None, 503,
                                   "service_unavailable", "store_unavailable") from None
            step = self.apply(new_sched, new_cache)
            self.updated_at = row.updated_at
            logger.info("scheduler config v%d (%s) applied after step %d: %s", self.version,
                        source, step, json.dumps(body, sort_keys=True))
            return {**self.snapshot(), "applied_after_step": step}

    def clamp(self, changes: dict[str, int], reason: str) -> None:
        """A guardrail's change: versioned and recorded like an operator's (source
        "guardrail"); the reason is in the log."""
        try:
            self.commit(changes, "guardrail")
        except _Invalid as exc:
            logger.warning("guardrail clamp %s (%s) not applied: %s", changes, reason, exc)

    async def patch(self, body: Any) -> dict[str, Any]:
        return await asyncio.to_thread(self.commit, body, "admin")

    async def history(self) -> list[dict[str, Any]]:
        if self.store is None:
            return []
        rows = await asyncio.to_thread(self.store.fetch, ConfigRow)
        return [dataclasses.asdict(r) for r in rows]


def install_admin_routes(app: FastAPI, async_engine: EngineAdmin, *,
                         store: Store | None = None,
                         telemetry: Telemetry | None = None) -> SchedulerConfigAdmin:
    """Add the /admin routes. With a store, the start-up config is recorded as version 1; with
    telemetry, its guardrails' auto-clamps go through here, into the config history."""
    admin = SchedulerConfigAdmin(async_engine, store=store)
    if telemetry is not None:
        telemetry.clamp_sink = admin.clamp
    app.state.scheduler_admin = admin
    @app.get("/admin/scheduler_config")
    async def get_scheduler_config() -> Any:
        return admin.snapshot()

    @app.patch("/admin/scheduler_config")
    async def patch_scheduler_config(request: Request) -> Any:
        try:
            body = loads(await request.body(), max_depth=4)
        except APIError as exc:
            return exc.response()
        try:
            return await admin.patch(body)
        except _Invalid as exc:
            return exc.response()

    @app.get("/admin/scheduler_config/history")
    async def scheduler_config_history() -> Any:
        return {"object": "list", "data": await admin.history()}

    return admin


def install_telemetry(app: FastAPI, async_engine: EngineAdmin, *, db: str | None,
                      registry: Any = None, guardrail_config: GuardrailConfig | None = None,
                      model_version: str = "unknown", max_queue: int = 10_000) -> Telemetry:
    """Attach telemetry (store when `db` is given, writer, recorder, guardrails and their
    monitor) to the app's engine; its metrics join `registry` when given; it is closed (queue
    flushed, store closed) when the app shuts down."""
    telemetry = open_telemetry(db, async_engine, monitor=True,
                               guardrail_config=guardrail_config, model_version=model_version,
                               max_queue=max_queue)
    if registry is not None:
        telemetry.register_metrics(registry)
    app.state.telemetry = telemetry
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        async with inner(a) as state:
            try:
                yield state
            finally:
                await asyncio.to_thread(telemetry.close)

    app.router.lifespan_context = lifespan
    return telemetry
