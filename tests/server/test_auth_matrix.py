"""Every route of the served app x every key configuration x {no key, API key, admin key} x
{loopback, remote client}, against docs/access.md's "Who may call what" table, read from the
doc: the doc and the code cannot drift apart, and a route without a row fails."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.routing import Route

from everystop.engine.async_engine import AsyncEngine
from everystop.engine.llm_engine import LLMEngine
from everystop.server.access import Access, AccessPolicy, is_loopback
from everystop.server.admin import install_admin_routes
from everystop.server.app import build_app
from everystop.server.dashboard import install_dashboard
from everystop.server.lora_admin import install_lora_routes
from everystop.server.metrics import ServerMetrics
from tests.engine.toy_engine import make_toy_engine
from tests.server.conftest import ROOT
from tests.server.fakes import ChatCharTokenizer

API_KEY, ADMIN_KEY = "the-api-key", "the-admin-key"
CONFIGS = {"No keys": (None, None), "API key only": (API_KEY, None),
           "Admin key only": (None, ADMIN_KEY), "Both keys": (API_KEY, ADMIN_KEY)}
CREDENTIALS = {"none": {}, "API key": {"Authorization": f"Bearer {API_KEY}"},
               "admin key (bearer)": {"Authorization": f"Bearer {ADMIN_KEY}"},
               "admin key (header)": {"X-Admin-Key": ADMIN_KEY}}
CLIENTS = {"loopback": ("127.0.0.1", 50000), "remote": ("203.0.113.7", 50000)}
CLUSTER_ONLY = {("GET", "/health/replicas")}  # added by `serve --replicas` (Ray)
EXAMPLE_PATHS = {"/v1/models/{model_id:path}": "/v1/models/toy",
                 "/dashboard/static/{name}": "/dashboard/static/dashboard.js"}


def read_table() -> dict[tuple[str, str, bool], dict[str, str]]:
    """(method, path, with --open-metrics) -> {configuration: who}."""
    text = (ROOT / "docs" / "access.md").read_text()
    section = text.split("## Who may call what", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[1:] == list(CONFIGS), header
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        m = re.match(r"`(\w+) (\S+)`", cells[0])
        assert m, f"unreadable row {line!r}"
        key = (m.group(1), m.group(2), "--open-metrics" in cells[0])
        assert key not in rows, f"two rows for {key}"
        rows[key] = dict(zip(CONFIGS, cells[1:], strict=True))
    return rows


TABLE = read_table()


def allowed(who: str, credential: str, client: str) -> bool:
    if who == "anyone":
        return True
    if who == "loopback":
        return client == "loopback"
    if who == "API key":
        return credential == "API key"
    assert who == "admin key", f"unknown entry {who!r} in docs/access.md"
    return credential.startswith("admin key")


@pytest.fixture(scope="module")
def front() -> Iterator[AsyncEngine]:
    eng = make_toy_engine()
    front = AsyncEngine(LLMEngine(eng.config, eng.executor, ChatCharTokenizer()))
    yield front
    front.shutdown()


def served_app(front: AsyncEngine, api_key: str | None, admin_key: str | None,
               open_metrics: bool) -> Any:
    """The app as `everystop serve` builds it (its telemetry store left out)."""
    metrics = ServerMetrics()

    def operator_routes(app: Any, engine: Any) -> None:
        install_admin_routes(app, engine)
        install_lora_routes(app, engine)
        install_dashboard(app, engine, metrics)

    return build_app(front, "toy", api_key=api_key, admin_key=admin_key, metrics=metrics,
                     open_metrics=open_metrics, extensions=[operator_routes])


def app_routes(app: Any) -> set[tuple[str, str]]:
    routes = set()
    for route in app.routes:
        assert isinstance(route, Route), f"{route!r}: not a plain route, unchecked"
        for method in route.methods or ():
            if method != "HEAD":
                routes.add((method, route.path))
    return routes


def test_the_table_and_the_app_name_the_same_routes(front: AsyncEngine) -> None:
    in_app = app_routes(served_app(front, None, None, False))
    in_doc = {(method, path) for method, path, _ in TABLE}
    assert in_app - in_doc == set(), "routes without a row in docs/access.md"
    assert in_doc - in_app == CLUSTER_ONLY, "rows for routes the app does not have"


def test_cluster_only_routes_are_classed_as_their_rows_say() -> None:
    # The cluster ingress needs Ray: its routes are checked against the policy directly.
    for method, path in CLUSTER_ONLY:
        row = TABLE[(method, path, False)]
        assert set(row.values()) == {"anyone"}
        assert AccessPolicy(API_KEY, ADMIN_KEY).route_access(path) is Access.PUBLIC


async def _status(app: Any, method: str, path: str, headers: dict[str, str],
                  client: tuple[str, int]) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, client=client)
    async with httpx.AsyncClient(transport=transport, base_url="http://everystop") as c:
        body = {} if method in ("POST", "PATCH") else None  # refused (400) if it gets through
        return await c.request(method, path, headers=headers, json=body)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_route_answers_exactly_whom_the_table_says(front: AsyncEngine, config: str) -> None:
    api_key, admin_key = CONFIGS[config]
    apps = {flag: served_app(front, api_key, admin_key, flag) for flag in (False, True)}
    cases = [(method, path, flag, who) for (method, path, flag), row in TABLE.items()
             if (method, path) not in CLUSTER_ONLY for who in [row[config]]]

    async def main() -> list[str]:
        wrong = []
        for method, template, open_metrics, who in cases:
            path = EXAMPLE_PATHS.get(template, template)
            for credential, headers in CREDENTIALS.items():
                for client, address in CLIENTS.items():
                    r = await _status(apps[open_metrics], method, path, headers, address)
                    expect = allowed(who, credential, client)
                    got = r.status_code not in (401, 403)
                    denial = 403 if who == "loopback" else 401
                    if got != expect or (not got and r.status_code != denial):
                        wrong.append(f"{method} {path} ({who}) with {credential} from {client}: "
                                     f"{r.status_code} {r.text[:120]}")
                    elif not got:
                        assert r.json()["error"]["code"] in (
                            "invalid_api_key", "invalid_admin_key",
                            "operator_route_loopback_only")
        return wrong

    wrong = asyncio.run(main())
    assert not wrong, "\n".join(wrong)


def test_a_route_nobody_classed_is_an_operator_route() -> None:
    policy = AccessPolicy()
    assert policy.route_access("/debug/new-thing") is Access.OPERATOR
    assert policy.route_access("/admin/anything") is Access.OPERATOR
    assert policy.route_access(None) is Access.API  # no route at all: the 404 is the API's


def test_an_empty_key_is_refused_not_taken_as_no_key() -> None:
    for keys in ({"api_key": ""}, {"admin_key": ""}):
        with pytest.raises(ValueError, match="must not be empty"):
            AccessPolicy(**keys)


def test_loopback_means_the_loopback_addresses_only() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("127.8.9.10") and is_loopback("::1")
    assert is_loopback("::ffff:127.0.0.1")
    for host in ("10.0.0.1", "192.168.1.5", "::ffff:10.0.0.1", "testclient", "", None):
        assert not is_loopback(host)


def test_the_start_up_line_says_which_rule_is_in_force() -> None:
    assert "loopback clients only" in AccessPolicy().describe()
    assert "need the API key" in AccessPolicy(api_key="k").describe()
    assert "need the admin key" in AccessPolicy(api_key="k", admin_key="a").describe()
