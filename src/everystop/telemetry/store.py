"""Where telemetry rows go: one Store interface, SQLite and PostgreSQL backends.

`open_store("telemetry.db")` gives SQLite (zero set-up); `open_store("postgresql://...")` gives
PostgreSQL through psycopg. Both create or migrate the schema on open. Every method may be
called from any thread (a lock serializes use of the one connection); none is ever called on the
engine thread - the writer thread and the admin routes (via a worker thread) do the I/O.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, TypeVar

from everystop.telemetry.rows import ConfigRow, Row
from everystop.telemetry.schema import LATEST_VERSION, Dialect, pending, schema_version_ddl

logger = logging.getLogger("everystop.telemetry")

R = TypeVar("R")


class Store(abc.ABC):
    """A telemetry database. Rows are the dataclasses of rows.py; times are epoch seconds."""

    dialect: Dialect
    placeholder: str

    def __init__(self) -> None:
        self._lock = threading.Lock()

    # -- backend primitives ---------------------------------------------------------------------
    @abc.abstractmethod
    def _connection(self) -> Any:
        """The live DB-API connection (reconnecting if the backend can)."""

    @abc.abstractmethod
    def _begin(self, cur: Any) -> None:
        """Start a transaction (SQLite: one that excludes other writers, so migrations are safe)."""

    def _to_db(self, t: float | None) -> Any:
        return t

    def _from_db(self, v: Any) -> float | None:
        return v

    def close(self) -> None:
        with self._lock:
            conn = getattr(self, "_conn", None)
            if conn is not None:
                conn.close()
                self._conn = None

    @contextmanager
    def _transaction(self) -> Iterator[Any]:
        with self._lock:
            conn = self._connection()
            cur = conn.cursor()
            try:
                self._begin(cur)
                yield cur
                conn.commit()
            except BaseException:
                conn.rollback()
                raise
            finally:
                cur.close()

    def _sql(self, sql: str) -> str:
        return sql.replace("?", self.placeholder)

    # -- schema ---------------------------------------------------------------------------------
    def migrate(self, target: int = LATEST_VERSION) -> int:
        """Apply pending migrations atomically; returns the schema version now in force."""
        with self._transaction() as cur:
            cur.execute(schema_version_ddl(self.dialect))
            cur.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version")
            applied = int(cur.fetchone()[0])
            for migration in pending(applied, target):
                logger.info("telemetry schema: applying v%d (%s)", migration.version,
                            migration.description)
                for stmt in migration.sql(self.dialect):
                    cur.execute(stmt)
                cur.execute(self._sql("INSERT INTO schema_version (version, description) "
                                      "VALUES (?, ?)"), (migration.version, migration.description))
                applied = migration.version
            return applied

    def schema_version(self) -> int:
        with self._transaction() as cur:
            cur.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version")
            return int(cur.fetchone()[0])

    # -- rows -----------------------------------------------------------------------------------
    def _columns(self, row_type: type) -> list[str]:
        return [f.name for f in dataclasses.fields(row_type)]

    def _encode(self, row: Row) -> tuple[Any, ...]:
        return tuple(self._to_db(v) if k in row.time_fields else v
                     for k, v in dataclasses.asdict(row).items())

    def _insert_sql(self, row_type: type, returning: str = "") -> str:
        cols = self._columns(row_type)
        sql = (f"INSERT INTO {row_type.table} ({', '.join(cols)}) "  # type: ignore[attr-defined]
               f"VALUES ({', '.join('?' * len(cols))})")
        return self._sql(sql + (f" RETURNING {returning}" if returning else ""))

    def insert(self, rows: Sequence[Row]) -> None:
        """Write rows of one or several types in one transaction."""
        by_type: dict[type, list[Row]] = {}
        for row in rows:
            by_type.setdefault(type(row), []).append(row)
        with self._transaction() as cur:
            for row_type, group in by_type.items():
                cur.executemany(self._insert_sql(row_type), [self._encode(r) for r in group])

    def insert_config(self, row: ConfigRow) -> int:
        """Persist one scheduler-config version; returns its config_id."""
        with self._transaction() as cur:
            cur.execute(self._insert_sql(ConfigRow, "config_id"), self._encode(row))
            return int(cur.fetchone()[0])

    def fetch(self, row_type: type[R], *, since: float | None = None) -> list[R]:
        """All rows of a type, oldest first by their first time field (arrival for sequences),
        optionally only those at or after `since`."""
        cols = self._columns(row_type)
        time_col = row_type.time_fields[0]  # type: ignore[attr-defined]
        sql = f"SELECT {', '.join(cols)} FROM {row_type.table}"  # type: ignore[attr-defined]
        params: tuple[Any, ...] = ()
        if since is not None:
            sql += f" WHERE {time_col} >= ?"
            params = (self._to_db(since),)
        sql += f" ORDER BY {time_col}"
        with self._transaction() as cur:
            cur.execute(self._sql(sql), params)
            records = cur.fetchall()
        times = set(row_type.time_fields)  # type: ignore[attr-defined]
        return [row_type(**{c: (self._from_db(v) if c in times else v)  # type: ignore[call-arg]
                            for c, v in zip(cols, rec)}) for rec in records]

    def count(self, row_type: type) -> int:
        with self._transaction() as cur:
            cur.execute(f"SELECT COUNT(*) FROM {row_type.table}")  # type: ignore[attr-defined]
            return int(cur.fetchone()[0])


class SqliteStore(Store):
    dialect: Dialect = "sqlite"
    placeholder = "?"

    def __init__(self, path: str, *, migrate: bool = True) -> None:
        super().__init__()
        self.path = path
        # isolation_level=None: we issue BEGIN ourselves so DDL is transactional too.
        self._conn: sqlite3.Connection | None = sqlite3.connect(
            path, isolation_level=None, check_same_thread=False, timeout=10.0)
        if path != ":memory:":
            self._conn.execute("PRAGMA journal_mode=WAL")  # readers (report) never block the writer
        self._conn.execute("PRAGMA synchronous=NORMAL")
        if migrate:
            self.migrate()

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("the store is closed")
        return self._conn

    def _begin(self, cur: Any) -> None:
        cur.execute("BEGIN IMMEDIATE")


class PostgresStore(Store):
    dialect: Dialect = "postgres"
    placeholder = "%s"
    _MIGRATION_LOCK = 0x65767279  # advisory lock key: one migrating server at a time

    def __init__(self, dsn: str, *, migrate: bool = True) -> None:
        super().__init__()
        self.dsn = dsn
        self._conn: Any = None
        self._connection()
        if migrate:
            self.migrate()

    def _connection(self) -> Any:
        import psycopg  # only PostgreSQL users need it

        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = psycopg.connect(self.dsn, autocommit=False, connect_timeout=10)
        return self._conn

    def _begin(self, cur: Any) -> None:
        pass  # psycopg opens a transaction at the first statement

    def migrate(self, target: int = LATEST_VERSION) -> int:
        with self._lock:  # two servers starting at once must not both run a migration
            conn = self._connection()
            with conn.cursor() as cur:
                cur.execute("SELECT pg_advisory_lock(%s)", (self._MIGRATION_LOCK,))
            conn.commit()
        try:
            return super().migrate(target)
        finally:
            with self._lock:
                conn = self._connection()
                with conn.cursor() as cur:
                    cur.execute("SELECT pg_advisory_unlock(%s)", (self._MIGRATION_LOCK,))
                conn.commit()

    def _to_db(self, t: float | None) -> Any:
        return None if t is None else datetime.fromtimestamp(t, UTC)

    def _from_db(self, v: Any) -> float | None:
        return None if v is None else v.timestamp()


def is_postgres_dsn(target: str) -> bool:
    return target.startswith(("postgresql://", "postgres://"))


def open_store(target: str, *, migrate: bool = True) -> Store:
    """A store for a SQLite path (or ':memory:') or a postgresql:// DSN, schema migrated."""
    if is_postgres_dsn(target):
        return PostgresStore(target, migrate=migrate)
    return SqliteStore(target, migrate=migrate)


def fetch_range(store: Store, row_type: type[R], since: float | None,
                until: float | None) -> list[R]:
    """Rows of a type whose first time field lies in [since, until] (epoch seconds)."""
    rows = store.fetch(row_type, since=since)
    if until is None:
        return rows
    field = row_type.time_fields[0]  # type: ignore[attr-defined]
    return [r for r in rows if getattr(r, field) <= until]
