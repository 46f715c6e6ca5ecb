"""LangGraph Studio / API: `langgraph dev` serves the agent graph offline; a run pauses at the plan review
and resumes through langgraph_sdk. The server listens on loopback only and is stopped by its PID."""

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


@pytest.fixture
def server(tmp_path: Path):
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
