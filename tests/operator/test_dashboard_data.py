"""/dashboard/data over a toy engine, in process: per (tenant, tier) rows, SLA status, alerts,
the scheduler config and its history, behind the admin key; the page and its assets offline."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from everystop.engine.async_engine import AsyncEngine
from everystop.server.admin import install_admin_routes, install_telemetry
from everystop.server.app import build_app
from everystop.server.dashboard import SlaJudge, install_dashboard
from everystop.server.metrics import ServerMetrics
from tests.server.fakes import SlowToyExecutor
from tests.telemetry.helpers import make_engine

KEY = {"X-Admin-Key": "k3y"}


def _app(tmp: Path) -> tuple[Any, Any, AsyncEngine]:
    front = AsyncEngine(make_engine(executor=SlowToyExecutor(256, 4, 0.002)))
    metrics = ServerMetrics()
    holder: dict[str, Any] = {}

    def observability(app: Any, front: Any) -> None:
        holder["telemetry"] = install_telemetry(app, front, db=str(tmp / "t.sqlite"),
                                                registry=metrics.registry, model_version="toy")
        install_admin_routes(app, front, store=holder["telemetry"].store,
                             telemetry=holder["telemetry"])
        install_dashboard(app, front, metrics)

    app = build_app(front, "toy", admin_key="k3y", metrics=metrics,
                    extensions=[observability])
    return app, holder["telemetry"], front


def test_dashboard_data_splits_by_tenant_and_tier_behind_the_admin_key(tmp_path: Path) -> None:
    app, telemetry, front = _app(tmp_path)

    async def main() -> tuple[httpx.Response, ...]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as c:
            jobs = [c.post("/v1/completions", json={
                "model": "toy", "prompt": f"{tenant} {tier} {i}", "max_tokens": 6,
                "stream": True, "user": tenant, "priority": tier})
                for tenant in ("acme", "zeta") for tier in (0, 1, 2) for i in range(2)]
            assert all(r.status_code == 200 for r in await asyncio.gather(*jobs))
            patched = await c.patch("/admin/scheduler_config", json={"max_num_seqs": 6},
                                    headers=KEY)
            assert patched.status_code == 200, patched.text
            return (await c.get("/dashboard/data"), await c.get("/dashboard/data", headers=KEY),
                    await c.get("/dashboard"), await c.get("/dashboard/static/uPlot.iife.min.js"),
                    await c.get("/dashboard/static/dashboard.js"),
                    await c.get("/dashboard/static/..%2Fdashboard.py"))

    try:
        denied, ok, page, uplot, script, escape = asyncio.run(main())
    finally:
        telemetry.close()
        front.shutdown()
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_admin_key"
    data = ok.json()
    rows = {(r["tenant"], r["tier"]): r for r in data["window"]["rows"]}
    assert set(rows) == {(t, p) for t in ("acme", "zeta") for p in (0, 1, 2)}
    for row in rows.values():
        assert row["requests"] == 2
        assert row["ttft_p99_s"] > 0 and row["tpot_p50_s"] > 0 and row["itl_p99_s"] > 0
        assert row["generation_tokens_per_s"] > 0 and row["sla"] in ("ok", "warn", "breach")
    assert set(data["window"]["by_tier"]) == {"0", "1", "2"}
    assert data["window"]["generation_tokens_per_s"] > 0
    assert data["engine"]["kv_total_blocks"] == 256
    assert data["guardrails"]["tier_queue_sla_s"] == {"0": 1.0, "1": 5.0, "2": 30.0}
    assert data["scheduler_config"]["version"] == 2
    assert data["scheduler_config"]["config"]["max_num_seqs"] == 6
    assert [(h["version"], h["source"]) for h in data["config_history"]] == \
        [(1, "startup"), (2, "admin")]
    # The page works offline: its assets are served here, nothing is fetched elsewhere.
    assert page.status_code == 200 and "/dashboard/static/uPlot.iife.min.js" in page.text
    assert "http" not in page.text.replace("http-equiv", "")
    assert uplot.status_code == 200 and "uPlot" in uplot.text
    assert script.status_code == 200 and "/dashboard/data" in script.text
    assert escape.status_code == 404


def test_sla_status_from_queue_wait_and_starvation_alerts() -> None:
    judge = SlaJudge(window_s=60)
    assert judge.status(0.1, 1.0, False) == "ok"
    assert judge.status(0.6, 1.0, False) == "warn"
    assert judge.status(1.2, 1.0, False) == "breach"
    assert judge.status(None, 1.0, True) == "breach"
    assert not judge.recent_starvation("0", 0, now=0.0)
    assert judge.recent_starvation("0", 1, now=10.0)  # a new alert
    assert judge.recent_starvation("0", 1, now=69.0)  # still within the window
    assert not judge.recent_starvation("0", 1, now=71.0)


def test_live_window_forgets_what_is_older_than_the_window() -> None:
    from everystop.core.outputs import RequestMetrics
    from everystop.server.live_window import LiveWindow

    now = [100.0]
    window = LiveWindow(window_s=10, clock=lambda: now[0])
    window.on_finished("a", 0, RequestMetrics(90.0, 90.5, 91.0, 95.0), 0.1, 40)
    window.on_itl("a", 0, 0.2, 3)  # one frame carrying three tokens: three gaps of 0.2 s
    window.on_rejected("tenant_queue", 0)
    now[0] = 104.0
    got = window.summary()
    (row,) = got["rows"]
    assert (row["tenant"], row["tier"], row["requests"]) == ("a", 0, 1)
    assert row["ttft_p99_s"] == 1.0 and row["queue_p50_s"] == 0.5 and row["itl_p50_s"] == 0.2
    assert row["streamed_tokens"] == 3 and row["generation_tokens_per_s"] == 10.0  # 40 / 4 s
    assert got["rejected_per_s"] == {"tenant_queue": 0.25}
    now[0] = 111.0
    assert window.summary()["rows"] == []
