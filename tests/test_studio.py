"""LangGraph Studio / API: `langgraph dev` serves the agent graph offline; a run pauses at the plan review
and resumes through langgraph_sdk, and two people's runs go at once into one shared (PostgreSQL) results
store. The server listens on loopback only, starts once per module and is stopped by its PID.

`langgraph dev` keeps threads and checkpoints in memory (its in-memory runtime cannot use PostgreSQL); the
PostgreSQL checkpointer is tested on its own in tests/test_postgres.py, the same saver a Postgres-backed
LangGraph server uses."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TASK = REPO / "tests" / "data" / "tasks" / "small_matmul"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp_path = tmp_path_factory.mktemp("langgraph-dev")
    exe = Path(sys.executable).parent / "langgraph"
    if not exe.exists():
        pytest.skip("langgraph-cli[inmem] is not installed (pip install -e '.[test]')")
    port = free_port()
    env = dict(os.environ, LANGGRAPH_CLI_NO_ANALYTICS="1", LANGSMITH_TRACING="false", PYTHONUNBUFFERED="1")
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            str(exe),
            "dev",
            "--no-browser",
            "--no-reload",
            "--allow-blocking",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError("langgraph dev exited:\n" + (tmp_path / "server.log").read_text()[-3000:])
            try:
                if httpx.get(f"{url}/ok", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError(
                "langgraph dev did not come up:\n" + (tmp_path / "server.log").read_text()[-3000:]
            )
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server we started, by its PID (its own process group)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        shutil.rmtree(REPO / ".langgraph_api", ignore_errors=True)


def test_studio_run_with_interrupt_and_resume(server: str, tmp_path: Path) -> None:
    from langgraph_sdk import get_sync_client

    client = get_sync_client(url=server)
    assistants = {a["graph_id"] for a in client.assistants.search()}
    assert {"agent", "search"} <= assistants
    thread = client.threads.create()
    context = {
        "model": "offline",
        "tpu": ["v5e"],
        "store_path": str(tmp_path / "results.db"),
        "work_dir": str(tmp_path / "work"),
    }
    client.runs.wait(
        thread["thread_id"],
        "agent",
        input={
            "task_path": str(TASK),
            "mode": "hitl",
            "max_iterations": 1,
            "out_dir": str(tmp_path / "out"),
            "tune_max_configs": 0,
        },
        context=context,
    )
    state = client.threads.get_state(thread["thread_id"])
    interrupts = [i for t in state["tasks"] for i in t.get("interrupts", [])]
    assert interrupts and interrupts[0]["value"][0]["kind"] == "plan_review"
    assert "matmul" in interrupts[0]["value"][0]["plan"].lower()

    replacement = "# Human plan\nOne output tile per grid step, K innermost, f32 accumulator."
    client.runs.wait(
        thread["thread_id"],
        "agent",
        command={"resume": {"action": "replace", "plan": replacement}},
        context=context,
    )
    state = client.threads.get_state(thread["thread_id"])
    interrupts = [i for t in state["tasks"] for i in t.get("interrupts", [])]
    assert interrupts and interrupts[0]["value"][0]["kind"] == "code_review"
    assert "pallas_call" in interrupts[0]["value"][0]["code"]

    client.runs.wait(thread["thread_id"], "agent", command={"resume": {"action": "approve"}}, context=context)
    final = client.threads.get_state(thread["thread_id"])["values"]
    assert final["status"] == "succeeded"
    assert final["plan"]["text"] == replacement
    assert (tmp_path / "out" / "kernel.py").exists()


def test_two_runs_at_once_through_the_sdk(server: str, pg_url: str, tmp_path: Path) -> None:
    """Two users start runs on two threads at once; both are queued on the server together, both finish, and
    both record their evaluations in one shared PostgreSQL results store (given in the run's context)."""
    from langgraph_sdk import get_sync_client

    from maxkernel.tools.store import ResultsStore

    client = get_sync_client(url=server)
    started = []
    for task in ("small_matmul", "small_gelu"):
        thread = client.threads.create(metadata={"user": f"user-of-{task}"})
        run = client.runs.create(
            thread["thread_id"],
            "agent",
            input={
                "task_path": str(TASK.parent / task),
                "mode": "auto",
                "max_iterations": 1,
                "out_dir": str(tmp_path / task),
                "tune_max_configs": 0,
            },
            context={
                "model": "offline",
                "tpu": ["v5e"],
                "store_path": pg_url,
                "work_dir": str(tmp_path / "w"),
            },
        )
        started.append((thread["thread_id"], run["run_id"], task))

    history: list[list[str]] = []  # the distinct (run 1, run 2) statuses seen, in order
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        statuses = [client.runs.get(t, r)["status"] for t, r, _ in started]
        if not history or history[-1] != statuses:
            history.append(statuses)
        if all(s not in ("pending", "running") for s in statuses):
            break
        time.sleep(0.5)
    assert statuses == ["success", "success"], statuses
    # Both were in flight together (submitted before either finished). `langgraph dev`'s in-memory runtime
    # was seen to execute them one after the other here; a Postgres-backed server runs them in parallel.
    assert history[0] != ["success", "success"] and len(history) >= 3, history
    for thread_id, _, task in started:
        values = client.threads.get_state(thread_id)["values"]
        assert values["status"] == "succeeded" and (tmp_path / task / "kernel.py").exists()
    store = ResultsStore(pg_url)
    assert store.executions("small_matmul") and store.executions("small_gelu")
