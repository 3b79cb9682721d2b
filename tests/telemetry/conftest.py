"""Every store-backed test runs against SQLite, and against PostgreSQL when
EVERYSTOP_TEST_PG_DSN names a server (CI starts one with scripts/start_postgres.sh). Each
PostgreSQL test gets a schema of its own, dropped afterwards."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from everystop.telemetry.store import Store, open_store

PG_DSN = os.environ.get("EVERYSTOP_TEST_PG_DSN")


def _with_search_path(dsn: str, schema: str) -> str:
    sep = "&" if "?" in dsn else "?"
    return f"{dsn}{sep}options=-c%20search_path%3D{schema}"


@pytest.fixture(params=["sqlite", "postgres"])
def store_target(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """A fresh, empty telemetry database: a SQLite path or a postgresql:// DSN."""
    if request.param == "sqlite":
        yield str(tmp_path / "telemetry.db")
        return
    if not PG_DSN:
        pytest.skip("EVERYSTOP_TEST_PG_DSN is not set (run scripts/start_postgres.sh)")
    import psycopg

    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        yield _with_search_path(PG_DSN, schema)
    finally:
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture
def store(store_target: str) -> Iterator[Store]:
    s = open_store(store_target)
    try:
        yield s
    finally:
        s.close()
