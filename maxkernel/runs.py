"""Run bookkeeping: who runs a thread, whether that process still lives, and what `maxkernel runs` shows.

A thread (one agent or search run) is run by one process at a time: it takes the thread's lease in the
results store (`ResultsStore.hold_lease`) and records itself as the owner (pid, host, heartbeat) with every
'running' status. A process killed by `kill -9` records nothing on its way out, so the status it left is
read against the lease and the pid here. None of this is about the command line: the CLI calls it, and so
can any other driver of a run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from maxkernel.tools.store import ResultsStore
from maxkernel.tools.store_sql import is_postgres
from maxkernel.tools.tasks import safe_task_id


class RunBusy(Exception):
    """Another process holds the thread's lease right now."""

    def __init__(self, thread_id: str, holder: str) -> None:
        super().__init__(
            f"thread {thread_id} is being run by {holder} right now; wait for it to finish or stop it"
        )
        self.thread_id = thread_id
        self.holder = holder


def take_lease(store: ResultsStore, thread_id: str) -> None:
    """One process per thread at a time (see `ResultsStore.hold_lease`): a second `resume` of a running
    thread is refused (`RunBusy`, naming the holder) instead of running every evaluation twice."""
    holder = store.hold_lease(thread_id)
    if holder is not None:
        raise RunBusy(thread_id, holder)


def lease_path(store: Path | str, thread_id: str) -> Path | None:
    """Where a SQLite store's lease for a thread lives (`ResultsStore.hold_lease`); None for PostgreSQL,
    whose leases are advisory locks in the server."""
    if is_postgres(str(store)):
        return None
    return Path(store).resolve().parent / "leases" / f"{safe_task_id(thread_id)}.lock"


def owner() -> dict[str, Any]:
    """Who runs a thread, recorded with every 'running' status: `runs` tells a live run from one whose
    process was killed (pid + host; the heartbeat says how recently it finished a step)."""
    import os
    import socket
    import time

    return {"owner_pid": os.getpid(), "owner_host": socket.gethostname(), "heartbeat_at": time.time()}


def owner_gone(row: dict[str, Any], store: Path | str | None) -> bool | None:
    """True when the process that last ran this thread is gone, False when it is alive, None when this
    machine cannot tell (another host, or a run recorded before owners were). On the owner's host the
    thread's lease decides (a lock the kernel drops when its holder dies, even by `kill -9`; a reused pid
    cannot fake it); without a lease file, whether the pid exists."""
    import fcntl
    import os
    import socket

    pid, host = row.get("owner_pid"), row.get("owner_host")
    if not pid or host != socket.gethostname():
        return None
    lease = lease_path(store, row["thread_id"]) if store is not None else None
    if lease is not None and lease.exists():
        with open(lease, "a+") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # held: its owner is alive
            fcntl.flock(fh, fcntl.LOCK_UN)
            return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # a process with that pid exists (another user's)
    return False


def shown_status(row: dict[str, Any], settings: dict[str, Any], store: Path | str | None = None) -> str:
    """The recorded status, except for a 'running' thread: with no checkpoint at all it never started;
    whose process is gone (killed, crashed, machine rebooted) it is interrupted and resumable; run by
    another host, it says which and when it last finished a step."""
    import socket
    import time

    status = row.get("status") or ""
    if status != "running":
        return status
    if not has_checkpoint(row["thread_id"], settings.get("checkpoint_db") or ""):
        return "never started"
    gone = owner_gone(row, store)
    if gone:
        return "interrupted (process gone), resumable"
    host = row.get("owner_host")
    if gone is None and host and host != socket.gethostname():
        beat = row.get("heartbeat_at")
        age = f", last step {time.time() - float(beat):.0f} s ago" if beat else ""
        return f"running on {host}{age}"
    return status


def has_checkpoint(thread_id: str, db: str) -> bool:
    """Whether the checkpoint database holds anything for the thread (True when it cannot be read here:
    a Postgres URL or a locked file is no evidence of a run that never started)."""
    if db.startswith(("postgres://", "postgresql://")):
        return True
    if not Path(db).exists():
        return False
    import sqlite3

    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            found = conn.execute(
                "SELECT 1 FROM checkpoints WHERE thread_id = ? LIMIT 1", (thread_id,)
            ).fetchone()
    except sqlite3.Error:
        return True
    return found is not None
