"""Runs in PostgreSQL: the results store and LangGraph checkpoints at a postgresql:// URL, against a real
server the session starts itself (tests/pg_server.py; skipped only where no server binary exists).

The store is one code path over two dialects, so its semantics are checked by running the same script on
SQLite and on PostgreSQL and comparing. Then the things a shared database must survive: processes creating
the schema at once, a lease held by a process that is killed, two runs at once with one of them killed -9
and resumed, and URLs that cannot be used (exit 2, within the connect timeout)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from maxkernel.tools.results import EvalResult
from maxkernel.tools.store import ResultsStore
from maxkernel.tools.tuning_table import TunedConfig, TuningKey, TuningTable

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "tests" / "data" / "tasks"
RUN_TIMEOUT_S = 600
"""Bounds a CLI process in these tests (a hang fails the test instead of stalling the suite)."""


def _script(store: ResultsStore) -> dict[str, Any]:
    """Every store operation the agent uses, with the observable results."""
    result = EvalResult(task_id="t1", source_hash="s1", accepted=True)
    store.put_evaluation("k1", "fp", {"tpu": ["v5e"]}, result, 1.5)
    store.put_evaluation("k1", "fp", {"tpu": ["v5e"]}, result, 2.5)  # an upsert, not a second row
    store.put_evaluation("k2", "fp", {}, EvalResult(task_id="t2", source_hash="s2", accepted=False), 0.1)
    for key, task in (("k2", "t2"), ("k1", "t1"), ("k3", "t1")):
        store.log_execution(key, task)
    store.put_model_reply("m1", "fake", "first")
    store.put_model_reply("m1", "fake", "second")
    store.put_reference_estimate("fp", "v5e", 1e-3)
    store.put_candidate("s1", "t1", "src one", "offline")
    store.put_candidate("s1", "t1", "src replaced?", "offline")  # ignored: the first source stays
    store.upsert_run("th-1", task_id="t1", status="running", settings=json.dumps({"a": 1}))
    store.upsert_run("th-1", status="succeeded")
    table = TuningTable(store)
    key = TuningKey(family="matmul", device_kind="TPU v5 lite", arg_spec="f32[8,8]")
    table.put(TunedConfig(**key.model_dump(), config={"bm": 8}, score_kind="measured", score=2.0))
    written = table.put(TunedConfig(**key.model_dump(), config={"bm": 16}, score_kind="estimated", score=9.0))
    run, stored = store.get_run("th-1"), store.get_evaluation("k1")
    assert run is not None and stored is not None
    return {
        "eval": stored.model_dump(),
        "missing": store.get_evaluation("nope"),
        "count": store.count_evaluations(),
        "count_t1": store.count_evaluations("t1"),
        "executions": store.executions(),
        "executions_t1": store.executions("t1"),
        "reply": store.get_model_reply("m1"),
        "estimate": store.get_reference_estimate("fp", "v5e"),
        "no_estimate": store.get_reference_estimate("fp", "v6e"),
        "candidate": store.sql.query("select source from candidates where source_hash = ?", ["s1"]),
        "run": {k: run[k] for k in ("task_id", "status", "settings")},
        "runs": [r["thread_id"] for r in store.list_runs()],
        "estimated_replaced_measured": written,
        "tuned": table.get(key).config,  # type: ignore[union-attr]
        "lease": store.hold_lease("th-1"),
        "lease_again": store.hold_lease("th-1"),  # this process holds it already
    }


def test_store_behaves_the_same_on_sqlite_and_postgres(pg_url: str, tmp_path: Path) -> None:
    on_sqlite = _script(ResultsStore(tmp_path / "results.db"))
    on_postgres = _script(ResultsStore(pg_url))
    assert on_postgres == on_sqlite
    assert on_sqlite["executions"] == ["k2", "k1", "k3"] and on_sqlite["executions_t1"] == ["k1", "k3"]
    assert on_sqlite["count"] == 2 and on_sqlite["count_t1"] == 1 and on_sqlite["reply"] == "second"
    assert on_sqlite["candidate"] == [{"source": "src one"}] and on_sqlite["tuned"] == {"bm": 8}
    assert on_sqlite["run"]["status"] == "succeeded" and on_sqlite["run"]["task_id"] == "t1"
    assert on_sqlite["lease"] is None and on_sqlite["estimated_replaced_measured"] is False
    with pytest.raises(ValueError, match="no column"):
        ResultsStore(pg_url).upsert_run("th-1", colour="blue")


def test_processes_creating_the_schema_at_once(pg_url: str) -> None:
    """Fresh database, four processes each opening the store and the checkpointer together: CREATE TABLE
    IF NOT EXISTS and LangGraph's migrations race in PostgreSQL unless serialised."""
    code = (
        "import sys; from maxkernel.tools.store import ResultsStore; "
        "from maxkernel.checkpointing import checkpointer_for; "
        "s = ResultsStore(sys.argv[1]); checkpointer_for(sys.argv[1]); s.log_execution('k', 't'); print('ok')"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, pg_url], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=RUN_TIMEOUT_S) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e.decode()[-2000:] for _, e in outs]
    assert ResultsStore(pg_url).executions() == ["k"] * 4


def test_a_thread_lease_is_freed_when_its_holder_is_killed(pg_url: str) -> None:
    code = (
        "import sys, time; from maxkernel.tools.store import ResultsStore; "
        "assert ResultsStore(sys.argv[1]).hold_lease('th-x') is None; print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, pg_url], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
        who = ResultsStore(pg_url).hold_lease("th-x")
        assert who is not None and f"pid {holder.pid}" in who
    finally:
        holder.kill()  # SIGKILL: no chance to unlock; the server drops the session's locks
        holder.wait()
    deadline = time.monotonic() + 30
    while (who := ResultsStore(pg_url).hold_lease("th-x")) is not None:
        assert time.monotonic() < deadline, f"lease still held by {who}"
        time.sleep(0.2)


def _mk(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "maxkernel.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


def test_two_runs_at_once_one_killed_and_resumed(pg_url: str, tmp_path: Path) -> None:
    """Two runs share one database (checkpoints and store) at the same time; one is killed -9 mid-run and
    resumed from another process: it re-runs no finished evaluation, and the other run is untouched."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", MAXKERNEL_STORE=pg_url, MAXKERNEL_CHECKPOINT_DB=pg_url)
    common = ["--model", "offline", "--tpu", "v5e", "--work-dir", str(tmp_path / "work")]
    victim = subprocess.Popen(
        [sys.executable, "-m", "maxkernel.cli", "optimize", str(TASKS / "small_matmul"), *common,
         "--iterations", "1", "--tune-configs", "3", "--out", str(tmp_path / "out-a"), "--thread-id", "pg-a"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    other = subprocess.Popen(
        [sys.executable, "-m", "maxkernel.cli", "optimize", str(TASKS / "small_gelu"), *common,
         "--iterations", "1", "--tune-configs", "0", "--out", str(tmp_path / "out-b"), "--thread-id", "pg-b"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline and victim.poll() is None:
            if len(ResultsStore(pg_url).executions("small_matmul")) >= 2:
                break
            time.sleep(0.3)
        assert victim.poll() is None, "the run finished before it could be killed"
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        done_before = ResultsStore(pg_url).executions("small_matmul")
        assert len(done_before) >= 2
        _, err = other.communicate(timeout=RUN_TIMEOUT_S)
        assert other.returncode == 0, err[-3000:]
    finally:
        for p in (victim, other):
            if p.poll() is None:
                p.kill()
                p.wait()

    resumed = _mk(tmp_path, "resume", "pg-a", "--store", pg_url)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "out-a" / "result.json").read_text())["correct"]
    assert json.loads((tmp_path / "out-b" / "result.json").read_text())["correct"]
    executions = ResultsStore(pg_url).executions("small_matmul")
    assert len(executions) == len(set(executions)), "an evaluation ran twice"
    assert executions[: len(done_before)] == done_before
    runs = {r["thread_id"]: r for r in ResultsStore(pg_url).list_runs()}
    assert runs["pg-a"]["status"] == runs["pg-b"]["status"] == "succeeded"
    assert json.loads(runs["pg-a"]["settings"])["store_path"] == pg_url
    listed = _mk(tmp_path, "runs", "--store", pg_url, "--json")
    assert {json.loads(line)["thread_id"] for line in listed.stdout.splitlines()} == {"pg-a", "pg-b"}


@pytest.mark.parametrize(
    ("flag", "url", "says"),
    [
        ("--store", "postgresql://postgres@127.0.0.1:1/none", "Connection refused"),
        ("--checkpoint-db", "postgresql://postgres@127.0.0.1:1/none", "Connection refused"),
        ("--store", "postgresql://[not-a-url", "cannot use PostgreSQL"),
        ("--store", "postgresql://bob:hunter2@127.0.0.1:1/x", "bob:***@"),
    ],
)
def test_unusable_postgres_url_is_exit_2(flag: str, url: str, says: str, tmp_path: Path) -> None:
    args = ["optimize", str(TASKS / "small_matmul"), "--model", "offline", "--work-dir", str(tmp_path / "w")]
    defaults = {"--store": str(tmp_path / "s.db"), "--checkpoint-db": str(tmp_path / "c.sqlite")}
    defaults[flag] = url
    r = _mk(tmp_path, *args, *(x for kv in defaults.items() for x in kv))
    assert r.returncode == 2, r.stderr[-3000:]
    said = " ".join(r.stderr.split())  # the console wraps long lines
    assert says in said and "Traceback" not in said and "hunter2" not in said


def test_missing_database_on_a_live_server_is_exit_2(pg_server: Any, tmp_path: Path) -> None:
    r = _mk(tmp_path, "runs", "--store", pg_server.url("no_such_db"))
    assert r.returncode == 2 and 'database "no_such_db" does not exist' in " ".join(r.stderr.split())
