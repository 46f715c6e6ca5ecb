"""Model usage written to the results store as each call ends, so a run's totals survive its process.

A node's state update is lost when the node does not finish: a 429 storm that ends the run, a `kill -9`
mid-step. The calls it made were billed (and rate-limited) all the same, so the author writes one row per
charge (a failed attempt, an answered call, its tokens) to the store's `model_usage` table the moment it
happens, under the run's key (thread / search branch). The nodes then copy the ledger's totals for their
run into the state: after a kill and a resume the state counts exactly the calls that were made, failed
ones included, and cached replies (a node re-run after a resume) count none.

The table (`store.MODEL_USAGE`) lives beside `model_replies` in the same store, SQLite or PostgreSQL.
"""

from __future__ import annotations

import time
from typing import Any

TABLE = "model_usage"


def record(store: Any, run_key: str, *, calls: int = 0, failed: int = 0, tokens: int = 0) -> None:
    """Append one charge for `run_key` (no-op without a store or key, or for an empty charge)."""
    if store is None or not run_key or not (calls or failed or tokens):
        return
    store.sql.insert(
        TABLE, {"run_key": run_key, "at": time.time(), "calls": calls, "failed": failed, "tokens": tokens}
    )


def totals(store: Any, run_key: str, since: float = 0.0) -> tuple[int, int] | None:
    """(calls, tokens) charged to `run_key` at or after `since` (a run's start: an older run that reused
    the thread id is not counted); None when nothing was charged to it yet."""
    if store is None or not run_key:
        return None
    row = store.sql.query(
        f"select count(*) as n, coalesce(sum(calls), 0) as calls, coalesce(sum(tokens), 0) as tokens "
        f"from {TABLE} where run_key = ? and at >= ?",
        [run_key, since],
    )[0]
    return (int(row["calls"]), int(row["tokens"])) if row["n"] else None
