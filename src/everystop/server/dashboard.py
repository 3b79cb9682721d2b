"""The built-in live page: GET /dashboard, its assets, and the JSON it polls.

  GET /dashboard                  the page (a shell: no numbers in it)
  GET /dashboard/static/<file>    its script, stylesheet and the vendored uPlot (no CDN)
  GET /dashboard/data             one JSON snapshot: engine state, the last minute's rates and
                                  exact percentiles per tier / tenant / (tenant, tier) with SLA
                                  status, guardrail alerts, the scheduler config and its history

The data is an operator route, as /admin (server/access.py: the admin key, else the API key,
else loopback clients only); the page takes the key from the URL fragment (`/dashboard#key=...`,
never sent to the server or its logs) or asks for it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, Response

from everystop import __version__
from everystop.engine.client import EngineClient
from everystop.server.metrics import ServerMetrics, prefix_hit_rate

STATIC = Path(__file__).with_name("static")
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css",
          "uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css"}
# A tier's row turns amber at this fraction of its queue-wait SLA, red at the SLA or when the
# guardrails raised a starvation alert for the tier within the window.
WARN_FRACTION = 0.5


class SlaJudge:
    """Colours (tenant, tier) rows from the guardrails: the tier's p99 queue-wait SLA and the
    starvation alerts raised for it recently."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._seen: dict[str, tuple[float, float]] = {}  # tier -> (alert count, last rise)

    def recent_starvation(self, tier: str, count: float, now: float) -> bool:
        last_count, last_rise = self._seen.get(tier, (0.0, -float("inf")))
        if count > last_count:
            last_rise = now
        self._seen[tier] = (count, last_rise)
        return now - last_rise <= self.window_s

    @staticmethod
    def status(queue_p99_s: float | None, sla_s: float | None, starving: bool) -> str:
        if starving or (sla_s and queue_p99_s is not None and queue_p99_s >= sla_s):
            return "breach"
        if sla_s and queue_p99_s is not None and queue_p99_s >= WARN_FRACTION * sla_s:
            return "warn"
        return "ok"


def _engine_state(front: EngineClient) -> dict[str, Any]:
    s = front.stats()
    return {"num_running": s.num_running, "num_waiting": s.num_waiting,
            "num_swapped": s.num_swapped, "kv_usage": s.kv_usage,
            "kv_watermark": front.cache_config.watermark, "kv_used_blocks": s.num_used_blocks,
            "kv_total_blocks": s.num_total_blocks,
            "preemptions": {"recompute": s.num_preemptions_recompute,
                            "swap": s.num_preemptions_swap},
            "prefix_hit_rate": prefix_hit_rate(s), "prefix_query_tokens": s.prefix_query_tokens,
            "prefix_hit_tokens": s.prefix_hit_tokens, "num_streams_open": front.num_in_flight,
            "draining": bool(front.draining)}


def _lora_state(front: EngineClient, metrics: ServerMetrics) -> dict[str, Any]:
    s = front.stats()
    return {"served": front.lora_adapters(), "running": list(s.running_lora_adapters),
            "waiting": list(s.waiting_lora_adapters), "max_loras": s.max_loras,
            "adapters": metrics.lora.totals()}


def _guardrails(app: FastAPI) -> dict[str, Any] | None:
    telemetry = getattr(app.state, "telemetry", None)
    if telemetry is None:
        return None
    g = telemetry.guardrails
    return {"tier_queue_sla_s": {str(t): v for t, v in enumerate(g.config.tier_queue_sla_s)},
            "queue_wait_p99_s": {str(t): v for t, v in sorted(g.queue_wait_p99_s.items())},
            "alerts": [{"kind": kind, "tier": tier, "count": n}
                       for (kind, tier), n in sorted(g.alerts_total.items())],
            "suspected_leaked_kv_blocks": g.suspected_leaked_blocks}


def _judge_rows(window: dict[str, Any], guard: dict[str, Any] | None, judge: SlaJudge,
                now: float) -> None:
    """Add an `sla` status to each row and tier of the window summary."""
    slas = {} if guard is None else guard["tier_queue_sla_s"]
    starving = {}
    for tier in {str(r["tier"]) for r in window["rows"]} | set(window["by_tier"]):
        count = 0.0 if guard is None else sum(
            a["count"] for a in guard["alerts"] if a["kind"] == "starvation" and a["tier"] == tier)
        starving[tier] = judge.recent_starvation(tier, count, now)
    for row in window["rows"]:
        tier = str(row["tier"])
        row["sla_s"] = slas.get(tier)
        row["sla"] = judge.status(row["queue_p99_s"], slas.get(tier), starving[tier])
    for tier, stats in window["by_tier"].items():
        stats["sla_s"] = slas.get(tier)
        stats["sla"] = judge.status(stats["queue_p99_s"], slas.get(tier), starving[tier])


def install_dashboard(app: FastAPI, front: EngineClient, metrics: ServerMetrics) -> None:
    """Add the /dashboard routes to `app` (they read, at request time, its telemetry and
    scheduler admin, when installed)."""
    judge = SlaJudge(metrics.window.window_s)

    @app.get("/dashboard")
    async def page() -> Response:
        return FileResponse(STATIC / "dashboard.html", media_type="text/html")

    @app.get("/dashboard/static/{name}")
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            return JSONResponse({"error": {"message": f"no asset {name!r}", "type":
                                           "invalid_request_error", "param": None,
                                           "code": "not_found"}}, 404)
        path = STATIC / name if name.startswith("dashboard") else STATIC / "vendor/uplot" / name
        return FileResponse(path, media_type=ASSETS[name])

    @app.get("/dashboard/data")
    async def data() -> Response:
        now = time.monotonic()
        window = metrics.window.summary()
        guard = _guardrails(app)
        _judge_rows(window, guard, judge, now)
        admin = getattr(app.state, "scheduler_admin", None)
        return JSONResponse({
            "object": "dashboard", "time": time.time(), "version": __version__,
            "model_name": metrics.model_name, "engine": _engine_state(front),
            "lora": _lora_state(front, metrics),
            "window": window, "guardrails": guard,
            "scheduler_config": None if admin is None else admin.snapshot(),
            "config_history": [] if admin is None else await admin.history()})
