"""The catch-all: an unexpected exception is a 500 with an id, logged with its traceback,
never shown to the client."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from everystop.engine.async_engine import AsyncEngine
from everystop.server.app import build_app
from tests.engine.toy_engine import make_toy_engine


@pytest.fixture
def app() -> Iterator[FastAPI]:
    front = AsyncEngine(make_toy_engine())

    def broken_route(app: FastAPI, _: AsyncEngine) -> None:
        @app.get("/boom")
        async def boom() -> None:
            raise KeyError("/secret/path/in/the/message")

    yield build_app(front, "toy", extensions=[broken_route])
    front.shutdown()


def test_unexpected_error_is_500_with_id_and_no_details(app: FastAPI,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    # From loopback: a route server/access.py does not name is an operator route.
    client = TestClient(app, raise_server_exceptions=False, client=("127.0.0.1", 50000))
    with caplog.at_level(logging.ERROR, logger="everystop.server"):
        r = client.get("/boom", headers={"X-Request-Id": "trace-me-1"})
    assert r.status_code == 500
    assert r.headers["x-request-id"] == "trace-me-1"
    err = r.json()["error"]
    assert err["type"] == "internal_server_error" and "trace-me-1" in err["message"]
    assert "secret" not in r.text and "KeyError" not in r.text
    logged = [rec for rec in caplog.records if "trace-me-1" in rec.getMessage()]
    assert logged and logged[0].exc_info is not None  # the traceback stays in the log
