"""The results store's SQL backends: SQLite (a file) or PostgreSQL (a `postgresql://` URL).

The store's code is one code path written in the SQL both engines share (`CREATE TABLE IF NOT EXISTS`,
`INSERT ... ON CONFLICT (pk) DO UPDATE SET c = excluded.c`, `ON CONFLICT DO NOTHING`). What differs sits in
the `Dialect` table below: parameter markers, column types, an auto-numbered column, how schema creation is
serialised between processes, and how a connection is made. Adding a backend is one more `Dialect`.

Connections: SQLite gets one connection per thread (WAL, generous busy timeout), as search branches run in
threads; PostgreSQL gets one connection pool per URL per process (psycopg_pool), autocommit. Connecting to
PostgreSQL has a timeout (`CONNECT_TIMEOUT_S`), so a wrong host or a dead server is an error in seconds,
never a hang; `DatabaseUnavailable` says which URL and why, without its password.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

POSTGRES_SCHEMES = ("postgres://", "postgresql://")
CONNECT_TIMEOUT_S = 10
"""Seconds to reach a PostgreSQL server before giving up (the driver's connect_timeout)."""
POOL_MAX_SIZE = 16
"""Connections per process per URL: search branches and autotune run in threads, each wanting one."""
SQLITE_BUSY_TIMEOUT_S = 60


class DatabaseUnavailable(RuntimeError):
    """A database URL that cannot be used: unreachable, refused, bad credentials, missing database,
    malformed, or the driver not installed. The CLI turns it into a usage error (exit 2)."""


def is_postgres(location: str | Path) -> bool:
    return isinstance(location, str) and location.startswith(POSTGRES_SCHEMES)


def redact(url: str) -> str:
    """The URL with any password replaced, for messages and logs."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)


def location_text(location: str | Path) -> str:
    """A store location as recorded for `resume`: a URL as given, a path made absolute."""
    return location if is_postgres(location) else str(Path(location).resolve())


@dataclass(frozen=True)
class Dialect:
    """What one SQL engine needs differently; everything else the store writes once."""

    name: str
    param: str
    """The driver's parameter marker; the store writes `?`, which is replaced by this."""
    column_types: dict[type, str]
    serial_column: str
    """DDL of an auto-numbered primary key column named `seq`, to keep insertion order (eval_log)."""
    order_column: str
    """What orders rows by insertion: SQLite's rowid (also for tables made before `seq` existed)."""

    def sql(self, text: str) -> str:
        return text if self.param == "?" else text.replace("?", self.param)


SQLITE = Dialect(
    name="sqlite",
    param="?",
    column_types={str: "TEXT", int: "INTEGER", float: "REAL"},
    serial_column="seq INTEGER PRIMARY KEY AUTOINCREMENT",
    order_column="rowid",
)
POSTGRES = Dialect(
    name="postgresql",
    param="%s",
    column_types={str: "TEXT", int: "BIGINT", float: "DOUBLE PRECISION"},
    serial_column="seq BIGSERIAL PRIMARY KEY",
    order_column="seq",
)


def quote(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"not a plain SQL identifier: {name!r}")
    return f'"{name}"'


class SqlBackend:
    """A dialect plus connections to one database; `query` and `execute` take `?` parameters."""

    dialect: Dialect

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        raise NotImplementedError

    def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        raise NotImplementedError

    @contextmanager
    def schema_lock(self) -> Iterator[SqlBackend]:
        """Serialise schema creation across threads and processes (two bench jobs starting together)."""
        raise NotImplementedError
        yield self

    # -- statements both engines share ----------------------------------------------------------------
    def create_table(self, table: str, columns: dict[str, type], pk: Sequence[str] | None) -> None:
        cols = [f"{quote(c)} {self.dialect.column_types[t]}" for c, t in columns.items()]
        if pk:
            cols.append(f"PRIMARY KEY ({', '.join(quote(c) for c in pk)})")
        self.execute(f"CREATE TABLE IF NOT EXISTS {quote(table)} ({', '.join(cols)})")

    def add_missing_columns(self, table: str, columns: dict[str, type]) -> None:
        """Columns a newer maxkernel added to an existing table (a store written by an older version)."""
        have = set(self.columns(table))
        for c, t in columns.items():
            if c in have:
                continue
            try:
                self.execute(
                    f"ALTER TABLE {quote(table)} ADD COLUMN {quote(c)} {self.dialect.column_types[t]}"
                )
            except Exception as exc:  # noqa: BLE001 - another process added it first
                if "duplicate" not in str(exc).lower() and "already exists" not in str(exc).lower():
                    raise

    def create_log_table(self, table: str, columns: dict[str, type]) -> None:
        cols = [self.dialect.serial_column] + [
            f"{quote(c)} {self.dialect.column_types[t]}" for c, t in columns.items()
        ]
        self.execute(f"CREATE TABLE IF NOT EXISTS {quote(table)} ({', '.join(cols)})")

    def create_index(self, table: str, columns: Sequence[str]) -> None:
        name = f"idx_{table}_{'_'.join(columns)}"
        self.execute(
            f"CREATE INDEX IF NOT EXISTS {quote(name)} ON {quote(table)} ({', '.join(quote(c) for c in columns)})"
        )

    def upsert(self, table: str, row: dict[str, Any], pk: Sequence[str]) -> None:
        """Insert, or update only the given columns of the existing row with that key."""
        cols = list(row)
        update = [c for c in cols if c not in pk]
        action = (
            "DO UPDATE SET " + ", ".join(f"{quote(c)} = excluded.{quote(c)}" for c in update)
            if update
            else "DO NOTHING"
        )
        self.execute(
            f"INSERT INTO {quote(table)} ({', '.join(quote(c) for c in cols)}) "
            f"VALUES ({', '.join('?' for _ in cols)}) "
            f"ON CONFLICT ({', '.join(quote(c) for c in pk)}) {action}",
            [row[c] for c in cols],
        )

    def insert(self, table: str, row: dict[str, Any], *, ignore_conflict: bool = False) -> None:
        cols = list(row)
        self.execute(
            f"INSERT INTO {quote(table)} ({', '.join(quote(c) for c in cols)}) "
            f"VALUES ({', '.join('?' for _ in cols)})"
            + (" ON CONFLICT DO NOTHING" if ignore_conflict else ""),
            [row[c] for c in cols],
        )

    def columns(self, table: str) -> list[str]:
        """Column names of a table, in order ([] if it does not exist)."""
        raise NotImplementedError

    def try_advisory_lock(self, name: str) -> tuple[Any, str]:
        """A lock across machines (PostgreSQL only; SQLite stores use a file lock beside the file)."""
        raise NotImplementedError(f"{self.dialect.name} has no advisory locks")


class SqliteBackend(SqlBackend):
    dialect = SQLITE
    _schema_lock = threading.Lock()

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()

    @property
    def conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(str(self.path), timeout=SQLITE_BUSY_TIMEOUT_S, isolation_level=None)
            conn.row_factory = sqlite3.Row
            enable_wal(conn)
            self._local.conn = conn
        return conn

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        return [dict(r) for r in self.conn.execute(sql, list(params)).fetchall()]

    def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        self.conn.execute(sql, list(params))  # autocommit (isolation_level=None): one statement, one commit

    @contextmanager
    def schema_lock(self) -> Iterator[SqlBackend]:
        # Two processes creating a fresh store at once race on the switch to WAL, and SQLite reports that
        # as "locked" without waiting: the caller retries (see `retry_locked`).
        with self._schema_lock:
            yield self

    def columns(self, table: str) -> list[str]:
        return [r["name"] for r in self.query(f"PRAGMA table_info({quote(table)})")]


def enable_wal(conn: sqlite3.Connection) -> None:
    """WAL lets readers and one writer work at once across processes. Switching needs a moment of exclusive
    access; when another process holds the file, it is (or soon will be) in WAL already: carry on."""
    try:
        conn.execute("PRAGMA journal_mode = WAL")
    except sqlite3.OperationalError:
        pass


def retry_locked(fn: Any, attempts: int = 40) -> Any:
    """Run `fn`, retrying SQLite's immediate "database is locked" (schema creation by several processes)."""
    for attempt in range(attempts):
        try:
            return fn()
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == attempts - 1:
                raise
            time.sleep(0.05 * (attempt + 1))
    return None


class PostgresBackend(SqlBackend):
    dialect = POSTGRES

    def __init__(self, url: str) -> None:
        self.url = url
        self.pool = postgres_pool(url)

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        with self.pool.connection() as conn:
            return list(conn.execute(self.dialect.sql(sql), list(params)).fetchall())

    def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        with self.pool.connection() as conn:
            conn.execute(self.dialect.sql(sql), list(params))

    @contextmanager
    def schema_lock(self) -> Iterator[SqlBackend]:
        # CREATE TABLE IF NOT EXISTS is not safe against a concurrent twin in PostgreSQL (a unique violation
        # on pg_type): an advisory lock serialises them.
        with advisory_lock(self.pool, "maxkernel-schema"):
            yield self

    def try_advisory_lock(self, name: str) -> tuple[Any, str]:
        """A session-level advisory lock on a connection kept out of the pool for the life of the process
        (the server drops the lock when the process dies). Returns (connection, "") once held, or
        (None, who holds it) from the holder's application_name (host and pid)."""
        import psycopg

        key = advisory_key(name)
        conn = psycopg.connect(self.url, **connect_kwargs())
        if conn.execute("SELECT pg_try_advisory_lock(%s) AS ok", [key]).fetchone()["ok"]:
            return conn, ""
        unsigned = key & 0xFFFFFFFFFFFFFFFF  # a bigint key shows in pg_locks as classid (high), objid (low)
        row = conn.execute(
            "SELECT a.application_name AS holder FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s AND l.objid = %s AND l.objsubid = 1",
            [unsigned >> 32, unsigned & 0xFFFFFFFF],
        ).fetchone()
        conn.close()
        return None, (row["holder"] if row and row["holder"] else "another process")

    def columns(self, table: str) -> list[str]:
        rows = self.query(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND table_name = ? ORDER BY ordinal_position",
            [table],
        )
        return [r["column_name"] for r in rows]


def advisory_key(text: str) -> int:
    """A signed 64-bit key for pg_advisory_lock, stable across processes and machines."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big", signed=True)


ADVISORY_WAIT_S = 300
"""How long a process waits for another to finish creating tables before giving up with an error."""


@contextmanager
def advisory_lock(pool: Any, name: str) -> Iterator[None]:
    """A session-level advisory lock on one pooled connection, taken by polling `pg_try_advisory_lock`
    rather than by a blocking `pg_advisory_lock`: a waiter blocked inside a statement is an open
    transaction, and LangGraph's migrations run `CREATE INDEX CONCURRENTLY`, which waits for every open
    transaction to end, so the holder would wait for the waiter forever."""
    key = advisory_key(name)
    with pool.connection() as conn:
        deadline = time.monotonic() + ADVISORY_WAIT_S
        while not conn.execute("SELECT pg_try_advisory_lock(%s) AS ok", [key]).fetchone()["ok"]:
            if time.monotonic() > deadline:
                raise DatabaseUnavailable(
                    f"waited {ADVISORY_WAIT_S} s for lock {name!r} held by another process"
                )
            time.sleep(0.1)
        try:
            yield
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", [key])


def connect_kwargs() -> dict[str, Any]:
    """What every maxkernel PostgreSQL connection uses: autocommit and dict rows (LangGraph's PostgresSaver
    requires both), no server-side prepared statements (transaction poolers such as pgbouncer break them),
    a connect timeout."""
    from psycopg.rows import dict_row

    return {
        "application_name": f"maxkernel {socket.gethostname()} pid {os.getpid()}",
        "autocommit": True,
        "prepare_threshold": None,
        "row_factory": dict_row,
        "connect_timeout": CONNECT_TIMEOUT_S,
    }


def check_postgres(url: str) -> None:
    """Connect once and fail with a clear `DatabaseUnavailable` (never hang) when the URL cannot be used."""
    try:
        import psycopg
    except ImportError as exc:
        raise DatabaseUnavailable(
            "a postgresql:// URL needs the postgres extra: pip install 'maxkernel[postgres]'"
        ) from exc
    try:
        with psycopg.connect(url, **connect_kwargs()) as conn:
            conn.execute("SELECT 1")
    except (psycopg.Error, ValueError) as exc:
        detail = redact(" ".join(str(exc).split())) or type(exc).__name__
        raise DatabaseUnavailable(f"cannot use PostgreSQL at {redact(url)}: {detail}") from exc


@cache
def postgres_pool(url: str) -> Any:
    """One connection pool per URL per process, checked before it is opened (so errors are clear)."""
    check_postgres(url)
    from psycopg_pool import ConnectionPool

    pool = ConnectionPool(
        url,
        kwargs=connect_kwargs(),
        min_size=1,
        max_size=POOL_MAX_SIZE,
        timeout=CONNECT_TIMEOUT_S * 6,
        open=False,
        name=f"maxkernel:{redact(url)}",
    )
    pool.open(wait=True, timeout=CONNECT_TIMEOUT_S * 2)
    return pool


def backend_for(location: str | Path) -> SqlBackend:
    return PostgresBackend(location) if is_postgres(location) else SqliteBackend(location)  # type: ignore[arg-type]
