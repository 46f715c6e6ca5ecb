"""The agent from the command line with the offline author: HITL across processes, kill -9 and resume,
`maxkernel runs`, and bad input. Every step is a separate process sharing the same SQLite files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from maxkernel.tools.store import ResultsStore

REPO = Path(__file__).resolve().parents[1]
TASK = REPO / "tests" / "data" / "tasks" / "small_matmul"


def mk(tmp: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "maxkernel.cli", *args],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


def files(tmp: Path) -> list[str]:
    return [
        "--checkpoint-db",
        str(tmp / "ck.sqlite"),
        "--store",
        str(tmp / "store.db"),
        "--work-dir",
        str(tmp / "work"),
    ]


def test_hitl_interrupt_then_resume_from_other_processes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = mk(tmp_path, "optimize", str(TASK), "--model", "offline", "--mode", "hitl", "--iterations", "1",
               "--tpu", "v5e", "--tune-configs", "0", "--out", str(out), "--thread-id", "hitl-1", *files(tmp_path))  # fmt: skip
    assert first.returncode == 3, first.stderr
    assert "paused for review (plan_review)" in first.stderr
    plan = tmp_path / "plan.md"
    plan.write_text("# Reviewed plan\nKeep the (m, n, k) grid with k innermost; fuse bias and relu.\n")
    second = mk(tmp_path, "resume", "hitl-1", "--plan-file", str(plan), "--store", str(tmp_path / "store.db"))
    assert second.returncode == 3, second.stderr
    assert "paused for review (code_review)" in second.stderr and "pallas_call" in second.stdout
    third = mk(tmp_path, "resume", "hitl-1", "--approve", "--store", str(tmp_path / "store.db"))
    assert third.returncode == 0, third.stderr
    result = json.loads((out / "result.json").read_text())
    assert result["correct"] and result["thread_id"] == "hitl-1"
    report = (out / "report.md").read_text()
    assert "Reviewed plan" in report and "plan_review: replace" in report
    runs = mk(tmp_path, "runs", "--store", str(tmp_path / "store.db"), "--json")
    row = next(json.loads(line) for line in runs.stdout.splitlines() if "hitl-1" in line)
    assert row["status"] == "succeeded"


def test_wrong_resume_option_is_a_usage_error(tmp_path: Path) -> None:
    first = mk(tmp_path, "optimize", str(TASK), "--model", "offline", "--mode", "hitl", "--tpu", "v5e",
               "--tune-configs", "0", "--thread-id", "hitl-2", *files(tmp_path))  # fmt: skip
    assert first.returncode == 3
    bad = mk(
        tmp_path,
        "resume",
        "hitl-2",
        "--code-file",
        str(TASK / "reference.py"),
        "--store",
        str(tmp_path / "store.db"),
    )
    assert bad.returncode == 2 and "does not answer a plan_review" in bad.stderr
    missing = mk(tmp_path, "resume", "nope", "--approve", "--store", str(tmp_path / "store.db"))
    assert missing.returncode == 2 and "no run with thread id" in missing.stderr


def test_kill_9_then_resume_reruns_no_finished_evaluation(tmp_path: Path) -> None:
    # One round, as in test_postgres's kill test: its implementation and three tuned configs leave work to do
    # after the second evaluation, when the kill comes; a second round only added evaluations nothing reads.
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "maxkernel.cli", "optimize", str(TASK), "--model", "offline", "--iterations", "1",
           "--tpu", "v5e", "--tune-configs", "3", "--out", str(out), "--thread-id", "kill-1", *files(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store_path = tmp_path / "store.db"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if store_path.exists() and len(ResultsStore(store_path).executions()) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = ResultsStore(store_path).executions()
    assert len(done_before) >= 2
    if (out / "result.json").exists():  # the best accepted kernel so far is kept on disk, labelled as such
        assert json.loads((out / "result.json").read_text())["status"].startswith("in progress")
        assert (out / "kernel.py").exists()

    resumed = mk(tmp_path, "resume", "kill-1", "--store", str(store_path))
    assert resumed.returncode == 0, resumed.stderr
    result = json.loads((out / "result.json").read_text())
    assert result["correct"]
    executions = ResultsStore(store_path).executions()
    assert len(executions) == len(set(executions)), "an evaluation ran twice"
    assert executions[: len(done_before)] == done_before


def test_bad_input_exit_2(tmp_path: Path) -> None:
    r = mk(tmp_path, "optimize", str(tmp_path / "missing"), "--model", "offline", *files(tmp_path))
    assert r.returncode == 2 and "task not found" in r.stderr
    r = mk(tmp_path, "optimize", str(TASK), "--mode", "sometimes", *files(tmp_path))
    assert r.returncode == 2 and "--mode" in r.stderr
    r = mk(
        tmp_path,
        "optimize",
        str(REPO / "tests" / "data" / "tasks" / "bad_syntax"),
        "--model",
        "offline",
        *files(tmp_path),
    )
    assert r.returncode == 2 and "syntax error" in r.stderr
    r = mk(tmp_path, "search", str(TASK), "--strategies", "warp_specialise", *files(tmp_path))
    assert r.returncode == 2 and "unknown strategy" in r.stderr
