"""The results store: every evaluation, keyed by what determines its outcome.

SQLite through sqlite-utils. The key of an evaluation is a hash of (task fingerprint, candidate source,
options, jax/jaxlib/libtpu versions), so a resumed or repeated run finds earlier work instead of redoing it,
and an upgrade of the compiler invalidates nothing silently: it simply misses.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import sqlite3
import threading
import time
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import sqlite_utils

from maxkernel.tools.results import EvalResult

_SCHEMA_LOCK = threading.Lock()


@lru_cache(maxsize=1)
def toolchain_versions() -> dict[str, str]:
    out = {}
    for pkg in ("jax", "jaxlib", "libtpu"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "absent"
    return out


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def evaluation_key(task_fingerprint: str, source_hash: str, options: dict[str, Any]) -> str:
    blob = json.dumps(
        {
            "task": task_fingerprint,
            "source": source_hash,
            "options": options,
            "versions": toolchain_versions(),
        },
        sort_keys=True,
    )
    return sha256_text(blob)


def enable_wal(conn: sqlite3.Connection) -> None:
    """WAL lets readers and one writer work at once across processes. Switching needs a moment of exclusive
    access; when another process holds the file, it is (or soon will be) in WAL already: carry on."""
    try:
        conn.execute("PRAGMA journal_mode = WAL")
    except sqlite3.OperationalError:
        pass


class ResultsStore:
    """Thin typed access to the store's tables; safe to use from several threads (search branches run in
    threads: each gets its own connection) and several processes (WAL, generous busy timeout)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        with _SCHEMA_LOCK:
            # Two processes creating a fresh store at once race on the switch to WAL, and SQLite reports
            # that as "locked" without waiting: retry a few times (bench jobs start together).
            for attempt in range(40):
                try:
                    self._ensure_tables()
                    break
                except sqlite3.OperationalError as exc:
                    if "locked" not in str(exc) or attempt == 39:
                        raise
                    time.sleep(0.05 * (attempt + 1))

    @property
    def db(self) -> sqlite_utils.Database:
        db = getattr(self._local, "db", None)
        if db is None:
            conn = sqlite3.connect(str(self.path), timeout=60)
            enable_wal(conn)
            db = sqlite_utils.Database(conn)
            self._local.db = db
        return db

    def _ensure_tables(self) -> None:
        if "evaluations" not in self.db.table_names():
            self.db["evaluations"].create(
                {
                    "key": str,
                    "task_id": str,
                    "task_fingerprint": str,
                    "source_hash": str,
                    "options": str,
                    "versions": str,
                    "accepted": int,
                    "error_stage": str,
                    "result": str,
                    "wall_s": float,
                    "created_at": str,
                },
                pk="key",
                if_not_exists=True,
            )
            self.db["evaluations"].create_index(["task_id"], if_not_exists=True)
        if "eval_log" not in self.db.table_names():
            # One row per evaluation executed to completion in a sandbox (a store hit adds none): lets a
            # resumed run prove it re-ran nothing that had finished.
            self.db["eval_log"].create({"key": str, "task_id": str, "started_at": str}, if_not_exists=True)
        if "model_replies" not in self.db.table_names():
            self.db["model_replies"].create(
                {"key": str, "model": str, "reply": str, "created_at": str}, pk="key", if_not_exists=True
            )
        if "reference_estimates" not in self.db.table_names():
            self.db["reference_estimates"].create(
                {"key": str, "estimated_seconds": float, "created_at": str}, pk="key", if_not_exists=True
            )
        if "runs" not in self.db.table_names():
            self.db["runs"].create(
                {
                    "thread_id": str,
                    "task_id": str,
                    "task_path": str,
                    "settings": str,
                    "status": str,
                    "best": str,
                    "out_dir": str,
                    "created_at": str,
                    "updated_at": str,
                },
                pk="thread_id",
                if_not_exists=True,
            )
        if "candidates" not in self.db.table_names():
            self.db["candidates"].create(
                {"source_hash": str, "task_id": str, "source": str, "origin": str, "created_at": str},
                pk="source_hash",
                if_not_exists=True,
            )

    def get_evaluation(self, key: str) -> EvalResult | None:
        rows = list(self.db.query("select result from evaluations where key = ?", [key]))
        if not rows:
            return None
        return EvalResult.model_validate_json(rows[0]["result"])

    def put_evaluation(
        self, key: str, task_fingerprint: str, options: dict[str, Any], result: EvalResult, wall_s: float
    ) -> None:
        self.db["evaluations"].upsert(
            {
                "key": key,
                "task_id": result.task_id,
                "task_fingerprint": task_fingerprint,
                "source_hash": result.source_hash,
                "options": json.dumps(options, sort_keys=True),
                "versions": json.dumps(toolchain_versions(), sort_keys=True),
                "accepted": int(result.accepted),
                "error_stage": result.error.stage if result.error else None,
                "result": result.model_dump_json(),
                "wall_s": wall_s,
                "created_at": _now(),
            },
            pk="key",
        )

    def log_execution(self, key: str, task_id: str) -> None:
        self.db["eval_log"].insert({"key": key, "task_id": task_id, "started_at": _now()})

    def executions(self, task_id: str | None = None) -> list[str]:
        """Keys of evaluations actually executed, in order, with repeats (there should be none)."""
        if task_id is None:
            return [r["key"] for r in self.db.query("select key from eval_log order by rowid")]
        return [
            r["key"]
            for r in self.db.query("select key from eval_log where task_id = ? order by rowid", [task_id])
        ]

    def get_model_reply(self, key: str) -> str | None:
        rows = list(self.db.query("select reply from model_replies where key = ?", [key]))
        return rows[0]["reply"] if rows else None

    def put_model_reply(self, key: str, model: str, reply: str) -> None:
        self.db["model_replies"].upsert(
            {"key": key, "model": model, "reply": reply, "created_at": _now()}, pk="key"
        )

    def _ref_key(self, task_fingerprint: str, gen: str) -> str:
        return sha256_text(json.dumps([task_fingerprint, gen, toolchain_versions()]))

    def get_reference_estimate(self, task_fingerprint: str, gen: str) -> float | None:
        """The TPU compiler's estimate for the reference: the same for every candidate, so computed once."""
        key = self._ref_key(task_fingerprint, gen)
        rows = list(self.db.query("select estimated_seconds from reference_estimates where key = ?", [key]))
        return rows[0]["estimated_seconds"] if rows else None

    def put_reference_estimate(self, task_fingerprint: str, gen: str, seconds: float) -> None:
        key = self._ref_key(task_fingerprint, gen)
        self.db["reference_estimates"].upsert(
            {"key": key, "estimated_seconds": seconds, "created_at": _now()}, pk="key"
        )

    def upsert_run(self, thread_id: str, **fields: Any) -> None:
        row = {"thread_id": thread_id, "updated_at": _now(), **fields}
        if not list(self.db.query("select 1 from runs where thread_id = ?", [thread_id])):
            row.setdefault("created_at", _now())
        self.db["runs"].upsert(row, pk="thread_id", alter=True)

    def get_run(self, thread_id: str) -> dict[str, Any] | None:
        rows = list(self.db.query("select * from runs where thread_id = ?", [thread_id]))
        return rows[0] if rows else None

    def list_runs(self) -> list[dict[str, Any]]:
        return list(self.db.query("select * from runs order by created_at desc"))

    def put_candidate(self, source_hash: str, task_id: str, source: str, origin: str) -> None:
        self.db["candidates"].insert(
            {
                "source_hash": source_hash,
                "task_id": task_id,
                "source": source,
                "origin": origin,
                "created_at": _now(),
            },
            pk="source_hash",
            ignore=True,
        )

    def count_evaluations(self, task_id: str | None = None) -> int:
        if task_id is None:
            return self.db["evaluations"].count
        return self.db["evaluations"].count_where("task_id = ?", [task_id])


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
