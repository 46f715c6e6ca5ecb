"""`maxkernel bench` over a two-task suite with the offline author: outputs, summary, resumability."""

from __future__ import annotations

import csv
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).parent / "data" / "tasks"


def test_bench_writes_report_and_skips_finished_tasks(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    for name in ("small_matmul", "sort_rows"):
        shutil.copytree(DATA / name, suite / name)
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "maxkernel", "bench", str(suite), "--model", "offline", "--tpu", "v5e",
           "--jobs", "2", "--out", str(out)]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "2 to run" in first.stderr and "correct 1/2" in first.stderr

    rows = {r["task_id"]: r for r in csv.DictReader(open(out / "results.csv"))}
    assert rows["small_matmul"]["correct"] == "True" and rows["small_matmul"]["status"] == "succeeded"
    assert rows["sort_rows"]["correct"] == "False" and "unsupported" in rows["sort_rows"]["error"]
    assert float(rows["small_matmul"]["estimated_speedup"]) > 0
    assert rows["small_matmul"]["measured_speedup"] == ""  # nothing measured without a device

    report = (out / "report.md").read_text()
    assert "| correct / total | 1 / 2 |" in report
    assert "geomean speedup, estimated (TPU model, not measured)" in report
    assert "geomean speedup, measured on a device | —" in report
    for png in ("status_by_category.png", "estimated_speedup.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    with sqlite3.connect(out / "results.db") as db:
        assert db.execute("select count(*) from results").fetchone()[0] == 2

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "2 already finished, 0 to run" in again.stderr
