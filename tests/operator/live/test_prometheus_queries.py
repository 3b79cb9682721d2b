"""Every query of dashboards/grafana/everystop.json, evaluated by a real Prometheus (Debian's
package) scraping a live `everystop serve` under load: each returns data, with the labels its
legend names, for both tenants and all three tiers where it splits by them."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.operator.live.conftest import MODEL_NAME, LiveServer, ensure_tools
from tests.operator.live.load import TENANTS, TIERS
from tests.server.conftest import ROOT, free_port

pytestmark = [pytest.mark.server, pytest.mark.model]

DASHBOARD = ROOT / "dashboards" / "grafana" / "everystop.json"
ALL = {"$model_name": ".*", "$tier": ".*", "$tenant": ".*", "$__rate_interval": "30s"}


def test_dashboard_file_is_what_the_generator_writes() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_grafana_dashboard.py"),
                           "--check"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


class Prometheus:
    def __init__(self, binary: str, target: str, tmp: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        config = tmp / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "everystop", "static_configs": [
                {"targets": [target]}]}]}))
        self._log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"prometheus not ready:\n{(tmp / 'prometheus.log').read_text()}")

    def query(self, promql: str) -> list[dict[str, Any]]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": promql}, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (promql, body)
        return body["data"]["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        r = httpx.get(self.url + f"/api/v1/label/{label}/values", params={"match[]": match},
                      timeout=10)
        return r.json()["data"]

    def stop(self) -> None:
        self.proc.kill()  # a throwaway database: no clean shutdown needed (it takes seconds)
        self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture(scope="module")
def prometheus(live_server: LiveServer, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Prometheus]:
    (binary,) = ensure_tools("prometheus")
    prom = Prometheus(binary, f"127.0.0.1:{live_server.server.port}",
                      tmp_path_factory.mktemp("prometheus"))
    yield prom
    prom.stop()


def _targets() -> list[tuple[str, str, str]]:
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"], t["legendFormat"]) for p in board["panels"]
            for t in p["targets"]]


def _fill(expr: str, values: dict[str, str]) -> str:
    for var, value in sorted(values.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    assert "$" not in expr, expr
    return expr


def _problem(prom: Prometheus, title: str, expr: str, legend: str) -> str | None:
    """Why this query's answer is not yet what the panel needs (None when it is)."""
    result = prom.query(_fill(expr, ALL))
    if not result:
        return f"{title}: no data for {expr}"
    wanted = re.findall(r"\{\{(\w+)\}\}", legend)
    for series in result:
        missing = [w for w in wanted if not series["metric"].get(w)]
        if missing:
            return f"{title}: series {series['metric']} lacks {missing}"
    if not any(math.isfinite(float(s["value"][1])) for s in result):
        return f"{title}: only NaN for {expr}"
    # Latency and per-tenant panels must show every tier / tenant the load drives.
    if "histogram_quantile" in expr or "by (tenant)" in expr:
        for label, expected in (("tier", {str(t) for t in TIERS}), ("tenant", set(TENANTS))):
            if label in wanted:
                got = {s["metric"][label] for s in result
                       if math.isfinite(float(s["value"][1]))}
                if not expected <= got:
                    return f"{title}: {label} values {sorted(got)}, want {sorted(expected)}"
    return None


def test_every_dashboard_query_returns_labelled_data(live_server: LiveServer,
                                                      prometheus: Prometheus) -> None:
    live_server.load.wait_for(per_group=2, timeout_s=120)
    targets = _targets()
    assert len(targets) >= 20
    deadline = time.monotonic() + 30  # a few scrapes after the load's first finishes
    while True:
        problems = [p for t in targets if (p := _problem(prometheus, *t)) is not None]
        if not problems or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not problems, "\n".join(problems)
    # The template variables list what the load produced.
    assert prometheus.label_values("model_name", "everystop:num_requests_running") == \
        [MODEL_NAME]
    match = "everystop:time_to_first_token_seconds_count"
    assert {str(t) for t in TIERS} <= set(prometheus.label_values("tier", match))
    assert set(TENANTS) <= set(prometheus.label_values("tenant", match))
    # A chosen tenant filters every per-tenant series down to that tenant.
    ttft = next(e for title, e, _ in targets if title == "TTFT by tenant")
    only = prometheus.query(_fill(ttft, {**ALL, "$tenant": "acme"}))
    assert only and {s["metric"]["tenant"] for s in only} == {"acme"}
    # Every series the server exports names the model.
    unnamed = prometheus.query('count by (__name__) ({job="everystop", __name__=~"everystop:.*",'
                               ' model_name=""})')
    assert not unnamed, unnamed
