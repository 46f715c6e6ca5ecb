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


def test_search_bench_searches_only_where_the_single_round_left_headroom(tmp_path: Path, monkeypatch) -> None:
    """The single round is the first column; the search runs only on correct tasks estimated below the
    threshold, and a task keeps the better of the two (never slower than its first accepted kernel)."""
    from maxkernel.bench import Bench, BenchSettings, TaskRow, family_of, family_table

    single = {"fast_task": 2.0, "slow_task": 0.5, "worse_search": 0.8, "broken": None}
    searched = {"slow_task": 1.4, "worse_search": 0.6}
    calls: list[tuple[str, bool]] = []

    def fake_phase(self, task, out, key, *, search):
        calls.append((task.name, search))
        value = (searched if search else single)[task.name]
        return TaskRow(task_id=task.name, correct=value is not None, estimated_speedup=value, seconds=1.0)

    monkeypatch.setattr(Bench, "_run_phase", fake_phase)
    bench = Bench(BenchSettings(suite=str(tmp_path), out_dir=str(tmp_path / "o"), algorithm="parallel"))
    rows = {name: bench._run_one(tmp_path / name) for name in single}
    assert sorted(n for n, s in calls if s) == ["slow_task", "worse_search"]
    assert rows["fast_task"].estimated_speedup == 2.0 and not rows["fast_task"].searched
    assert rows["slow_task"].estimated_speedup == 1.4 and rows["slow_task"].single_estimated_speedup == 0.5
    assert (
        rows["worse_search"].estimated_speedup == 0.8 and rows["worse_search"].search_estimated_speedup == 0.6
    )
    assert not rows["broken"].searched

    assert family_of("op_flash_attention_causal") == "attention"
    assert family_of("fused_matmul_bias_layernorm_gelu") == "matmul chains"
    assert family_of("fused_conv2d_batchnorm_relu") == "convolutions"
    assert family_of("op_rmsnorm") == "norms"
    table = {
        f["family"]: f
        for f in family_table([r.model_copy(update={"family": "matmul chains"}) for r in rows.values()])
    }
    assert table["matmul chains"]["searched"] == 2 and table["matmul chains"]["final_fast1"] == 2
