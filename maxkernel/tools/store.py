"""The results store: every evaluation, keyed by what determines its outcome.

SQLite (a file path) or PostgreSQL (a `postgresql://` URL, so a team's runs share one store): one code path
over `store_sql`'s small dialect seam. The key of an evaluation is a hash of (task fingerprint, candidate source,
options, jax/jaxlib/libtpu versions), so a resumed or repeated run finds earlier work instead of redoing it,
and an upgrade of the compiler invalidates nothing silently: it simply misses.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

from maxkernel.tools.results import EvalResult
from maxkernel.tools.store_sql import (
    SqlBackend,
    backend_for,
    enable_wal,
    is_postgres,
    location_text,
    retry_locked,
)

__all__ = [
    "ResultsStore",
    "enable_wal",
    "harness_fingerprint",
    "evaluation_key",
    "sha256_text",
    "toolchain_versions",
]


@lru_cache(maxsize=1)
def harness_fingerprint() -> str:
    """A hash of the harness's own sources (`maxkernel/tools`, the estimators included), part of every key
    under which a verdict or an estimate is stored: a result is only as good as the code that reached it.
    Keyed by the toolchain alone, a fixed check kept answering with the old code's cached verdict, and a
    reference estimate from before the loop pricing (the compiler's price for one iteration of a 64-trip
    `lax.map`) was served long after it, off by the trip count."""
    h = hashlib.sha256()
    tools = Path(__file__).resolve().parent
    for path in sorted(tools.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


@lru_cache(maxsize=1)
def _package_versions() -> tuple[tuple[str, str], ...]:
    out = []
    for pkg in ("jax", "jaxlib", "libtpu"):
        try:
            out.append((pkg, metadata.version(pkg)))
        except metadata.PackageNotFoundError:
            out.append((pkg, "absent"))
    return tuple(out)


def package_versions() -> dict[str, str]:
    """jax, jaxlib and libtpu versions ("absent" where not installed)."""
    return dict(_package_versions())


def toolchain_versions() -> dict[str, str]:
    """What a stored verdict or estimate depends on besides its inputs: the JAX toolchain and the harness's
    own code (which holds the estimators too)."""
    return {**dict(_package_versions()), "maxkernel-harness": harness_fingerprint()}


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


TABLES: dict[str, dict[str, type]] = {
    "evaluations": {
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
    "model_replies": {"key": str, "model": str, "reply": str, "created_at": str},
    "reference_estimates": {"key": str, "estimated_seconds": float, "created_at": str},
    "runs": {
        "thread_id": str,
        "task_id": str,
        "task_path": str,
        "settings": str,
        "status": str,
        "best": str,
        "out_dir": str,
        "created_at": str,
        "updated_at": str,
        # who runs it now (`maxkernel.runs.owner`): a dead owner's 'running' run reads as interrupted
        "owner_pid": int,
        "owner_host": str,
        "heartbeat_at": float,
    },
    "candidates": {"source_hash": str, "task_id": str, "source": str, "origin": str, "created_at": str},
}
"""The keyed tables and their columns (the first column is the primary key)."""

EVAL_LOG = {"key": str, "task_id": str, "started_at": str}
MODEL_USAGE = {"run_key": str, "at": float, "calls": int, "failed": int, "tokens": int}
"""One row per model charge as it happens (`authors.usage_ledger`): totals survive a killed process."""
"""One row per evaluation executed to completion in a sandbox (a store hit adds none), in order: lets a
resumed run prove it re-ran nothing that had finished."""


class ResultsStore:
    """Thin typed access to the store's tables; safe to use from several threads (search branches run in
    threads) and several processes, on one machine (SQLite: WAL, generous busy timeout) or many
    (PostgreSQL). `location` is a file path or a postgresql:// URL."""

    def __init__(self, location: str | Path) -> None:
        if not is_postgres(location):
            location = Path(location)
        self.location = location_text(location)
        """Where the store is, as `resume` records it: an absolute path or the URL."""
        self.path: Path | None = None if is_postgres(location) else Path(location)
        self.sql: SqlBackend = backend_for(location)
        with self.sql.schema_lock():
            retry_locked(self._ensure_tables)

    def _ensure_tables(self) -> None:
        for table, columns in TABLES.items():
            self.sql.create_table(table, columns, pk=[next(iter(columns))])
            self.sql.add_missing_columns(table, columns)
        self.sql.create_index("evaluations", ["task_id"])
        self.sql.create_log_table("eval_log", EVAL_LOG)
        self.sql.create_log_table("model_usage", MODEL_USAGE)
        self.sql.create_index("model_usage", ["run_key"])

    def get_evaluation(self, key: str) -> EvalResult | None:
        rows = self.sql.query("select result from evaluations where key = ?", [key])
        if not rows:
            return None
        return EvalResult.model_validate_json(rows[0]["result"])

    def put_evaluation(
        self, key: str, task_fingerprint: str, options: dict[str, Any], result: EvalResult, wall_s: float
    ) -> None:
        self.sql.upsert(
            "evaluations",
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
            pk=["key"],
        )

    def log_execution(self, key: str, task_id: str) -> None:
        self.sql.insert("eval_log", {"key": key, "task_id": task_id, "started_at": _now()})

    def executions(self, task_id: str | None = None) -> list[str]:
        """Keys of evaluations actually executed, in order, with repeats (there should be none)."""
        order = self.sql.dialect.order_column
        if task_id is None:
            return [r["key"] for r in self.sql.query(f"select key from eval_log order by {order}")]
        return [
            r["key"]
            for r in self.sql.query(f"select key from eval_log where task_id = ? order by {order}", [task_id])
        ]

    def get_model_reply(self, key: str) -> str | None:
        rows = self.sql.query("select reply from model_replies where key = ?", [key])
        return rows[0]["reply"] if rows else None

    def put_model_reply(self, key: str, model: str, reply: str) -> None:
        self.sql.upsert(
            "model_replies", {"key": key, "model": model, "reply": reply, "created_at": _now()}, pk=["key"]
        )

    def _ref_key(self, task_fingerprint: str, gen: str) -> str:
        return sha256_text(json.dumps([task_fingerprint, gen, toolchain_versions()]))

    def get_reference_estimate(self, task_fingerprint: str, gen: str) -> float | None:
        """The TPU compiler's estimate for the reference: the same for every candidate, so computed once."""
        key = self._ref_key(task_fingerprint, gen)
        rows = self.sql.query("select estimated_seconds from reference_estimates where key = ?", [key])
        return rows[0]["estimated_seconds"] if rows else None

    def put_reference_estimate(self, task_fingerprint: str, gen: str, seconds: float) -> None:
        key = self._ref_key(task_fingerprint, gen)
        self.sql.upsert(
            "reference_estimates",
            {"key": key, "estimated_seconds": seconds, "created_at": _now()},
            pk=["key"],
        )

    def upsert_run(self, thread_id: str, **fields: Any) -> None:
        unknown = set(fields) - set(TABLES["runs"])
        if unknown:
            raise ValueError(f"runs has no column(s) {sorted(unknown)}")
        row = {"thread_id": thread_id, "updated_at": _now(), **fields}
        if not self.sql.query("select 1 from runs where thread_id = ?", [thread_id]):
            row.setdefault("created_at", _now())
        self.sql.upsert("runs", row, pk=["thread_id"])

    def get_run(self, thread_id: str) -> dict[str, Any] | None:
        rows = self.sql.query("select * from runs where thread_id = ?", [thread_id])
        return rows[0] if rows else None

    def list_runs(self) -> list[dict[str, Any]]:
        return self.sql.query("select * from runs order by created_at desc")

    def put_candidate(self, source_hash: str, task_id: str, source: str, origin: str) -> None:
        self.sql.insert(
            "candidates",
            {
                "source_hash": source_hash,
                "task_id": task_id,
                "source": source,
                "origin": origin,
                "created_at": _now(),
            },
            ignore_conflict=True,
        )

    def hold_lease(self, thread_id: str) -> str | None:
        """Take this process's exclusive lease on a thread, held until the process exits (the kernel, or the
        PostgreSQL server when the connection drops, releases it even after `kill -9`). Returns None once
        held (also when this process holds it already), else who holds it. One process per thread, so a
        second `resume` of a running thread cannot run every evaluation twice."""
        if (self.location, thread_id) in _LEASES:
            return None
        if self.path is None:
            handle, holder = self.sql.try_advisory_lock(f"thread:{thread_id}")
        else:
            handle, holder = _file_lease(self.path.resolve().parent / "leases", thread_id)
        if handle is None:
            return holder
        _LEASES[(self.location, thread_id)] = handle
        return None

    def count_evaluations(self, task_id: str | None = None) -> int:
        if task_id is None:
            return int(self.sql.query("select count(*) as n from evaluations")[0]["n"])
        return int(
            self.sql.query("select count(*) as n from evaluations where task_id = ?", [task_id])[0]["n"]
        )


_LEASES: dict[tuple[str, str], Any] = {}
"""Leases this process holds, (store location, thread id) -> the open file or connection that holds it."""


def _file_lease(directory: Path, thread_id: str) -> tuple[Any, str]:
    """An exclusive flock on `<directory>/<thread>.lock` (the holder's pid written inside)."""
    import fcntl
    import os

    from maxkernel.tools.tasks import safe_task_id

    path = directory / f"{safe_task_id(thread_id)}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "a+")  # noqa: SIM115 - held for the life of the process
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        fh.close()
        return None, holder
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()}")
    fh.flush()
    return fh, ""


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
