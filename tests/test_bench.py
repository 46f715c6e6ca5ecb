"""`maxkernel bench` over a two-task suite with the offline author: outputs, summary, resumability."""

from __future__ import annotations

import csv
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

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

    # The offline author never reads the profile step's trace: the bench skips it, and the report says so.
    task_report = (out / "tasks" / "small_matmul" / "report.md").read_text()
    assert "## Profile" not in task_report and "skipped the profile step" in task_report

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "2 already finished, 0 to run" in again.stderr


def test_search_bench_searches_only_where_the_single_round_left_headroom(tmp_path: Path, monkeypatch) -> None:
    """The single round is the first column; the search runs only on correct tasks estimated below the
    threshold, and a task keeps the better of the two (never slower than its first accepted kernel)."""
    from maxkernel.bench import Bench, BenchSettings, TaskRow, family_of, family_table, render_report

    single = {"fast_task": 2.0, "slow_task": 0.5, "worse_search": 0.8, "broken": None, "two_gens": 0.9133}
    searched = {"slow_task": 1.4, "worse_search": 0.6, "two_gens": 0.9134}
    by_gen = {
        (False, "two_gens"): {"v5e": 0.9133, "v6e": 0.742},
        (True, "two_gens"): {"v5e": 0.9134, "v6e": 0.407},
    }
    calls: list[tuple[str, bool]] = []

    def fake_phase(self, task, out, key, *, search):
        calls.append((task.name, search))
        value = (searched if search else single)[task.name]
        return TaskRow(task_id=task.name, correct=value is not None, estimated_speedup=value, seconds=1.0,
                       estimated_speedup_by_generation=by_gen.get((search, task.name), {}))  # fmt: skip

    monkeypatch.setattr(Bench, "_run_phase", fake_phase)
    bench = Bench(BenchSettings(suite=str(tmp_path), out_dir=str(tmp_path / "o"), algorithm="parallel"))
    rows = {name: bench._run_one(tmp_path / name) for name in single}
    assert sorted(n for n, s in calls if s) == ["slow_task", "two_gens", "worse_search"]
    # ranked by the geomean over generations: a hair faster on v5e, 45% slower on v6e is not better
    assert rows["two_gens"].estimated_speedup_by_generation["v6e"] == 0.742 and rows["two_gens"].searched
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
    assert table["matmul chains"]["searched"] == 3 and table["matmul chains"]["final_fast1"] == 2
    # the single round per generation, beside the final one (it was the first generation's only)
    assert rows["two_gens"].single_estimated_speedup_by_generation == {"v5e": 0.9133, "v6e": 0.742}
    assert table["matmul chains"]["single_by_generation"] == {"v5e": 0.9133, "v6e": 0.742}
    report = render_report(list(rows.values()), bench.s, 1.0, [])
    assert "| single v5e | final v5e | single v6e | final v6e |" in report
    assert "Single round (no search): geomean estimated" in report and "(v5e 0.91x, v6e 0.74x)." in report


def test_plain_bench_reports_its_single_round_and_the_first_accepted_check(tmp_path: Path) -> None:
    """Without --algorithm the run is its own single round (the report used to say "single round —" and
    "fast₁ single 0"), and every task says whether its final kernel is at least as fast (estimated) as its
    first accepted one."""
    import json

    from maxkernel.bench import BenchSettings, TaskRow, _read_result, family_table, render_report, summary

    def result(out: Path, **fields) -> TaskRow:
        out.mkdir(parents=True)
        final = fields.pop("final")
        by_gen = {"v5e": {"estimated_speedup": final}, "v6e": {"estimated_speedup": fields.pop("v6e", None)}}
        harness = {
            "compiled": True,
            "uses_pallas": True,
            "estimate": {"estimated_speedup": final, "by_generation": by_gen},
        }
        (out / "result.json").write_text(json.dumps({"correct": True, "status": "succeeded", "harness": harness,
                                                      **fields}))  # fmt: skip
        return _read_result(TaskRow(task_id=out.name, family="norms"), out, 0, out / "bench.log")

    ms = lambda v: {"iteration": 1, "kind": "implement", "estimated_speedup": v}  # noqa: E731
    kept = result(
        tmp_path / "kept", final=2.0, v6e=3.0, iterations=2, round_one_best=ms(1.5), first_accepted=ms(1.2)
    )
    slower = result(
        tmp_path / "slower", final=0.9, iterations=1, round_one_best=ms(0.9), first_accepted=ms(1.1)
    )
    old = result(tmp_path / "old", final=1.3, iterations=1)  # a result.json from before the milestones
    assert (kept.single_estimated_speedup, kept.first_accepted_estimated_speedup) == (1.5, 1.2)
    assert old.single_estimated_speedup == 1.3 and old.first_accepted_estimated_speedup is None

    rows = [kept, slower, old]
    m = summary(rows)
    assert (m["kept_first"], m["kept_first_n"], m["slower_than_first"]) == (1, 2, ["slower"])
    (fam,) = family_table(rows)
    assert fam["single_fast1"] == 2 and fam["single_geomean"] is not None
    report = render_report(rows, BenchSettings(suite="s", out_dir=str(tmp_path), iterations=2), 1.0, [])
    assert "Single round (no search): geomean estimated 1.21x, fast₁ 2 / 3." in report
    assert "at least as fast (estimated) as the task's first accepted kernel: 1 / 2" in report
    assert "NOT on slower." in report and "✗ (first 1.10x)" in report
    # Every generation estimated gets its own figures (issue 12: v5e AND v6e), named as estimates.
    v6e = m["by_generation"]["v6e"]
    assert v6e["geomean"] == pytest.approx(3.0) and (v6e["fast1"], v6e["clear"], v6e["n"]) == (1, 1, 1)
    assert (
        "| on v6e, estimated: geomean / fast₁ / > 1.25x | 3.00x / 1 / 1 (over 1 with a v6e estimate) |"
        in report
    )
    assert "| est. v5e | est. v6e |" in report and "| 2.00x | 2.00x | 3.00x | ✓ |" in report


def test_results_db_from_before_the_generation_column_still_reads(tmp_path: Path) -> None:
    """Resumability: a results.db written before `estimated_speedup_by_generation` existed reads as {}."""
    import sqlite_utils

    from maxkernel.bench import Bench, BenchSettings

    suite = tmp_path / "suite"
    shutil.copytree(DATA / "small_matmul", suite / "small_matmul")
    out = tmp_path / "o"
    out.mkdir()
    old = {"task_id": "small_matmul", "status": "succeeded", "correct": True, "tpu_compile": '{"v5e": true}',
           "estimated_speedup": 1.5}  # fmt: skip
    sqlite_utils.Database(out / "results.db")["results"].insert(old, pk="task_id")
    bench = Bench(BenchSettings(suite=str(suite), out_dir=str(out)), on_progress=lambda _m: None)
    (row,) = bench.rows([suite / "small_matmul"])
    assert row.estimated_speedup == 1.5 and row.estimated_speedup_by_generation == {}
    assert "small_matmul" in bench._done()


def test_finalize_records_the_first_accepted_and_round_one_best() -> None:
    from maxkernel.nodes.finalize import accepted_milestones
    from maxkernel.state import Attempt

    def att(it: int, accepted: bool, est: float | None) -> Attempt:
        return Attempt(iteration=it, kind="implement", source_hash=f"h{it}{est}", source_path="",
                       stage="accepted" if accepted else "compile", accepted=accepted, estimated_speedup=est)  # fmt: skip

    got = accepted_milestones([att(1, False, None), att(1, True, 0.8), att(1, True, 1.1), att(2, True, 1.6)])
    assert got["first_accepted"]["estimated_speedup"] == 0.8
    assert got["round_one_best"]["estimated_speedup"] == 1.1
    assert accepted_milestones([att(1, False, None)]) == {"first_accepted": None, "round_one_best": None}


def test_candidates_rank_by_the_geomean_over_the_targeted_generations() -> None:
    """One kernel serves every targeted generation (issue 12: v5e AND v6e), so the agent, the autotuner, the
    search and the bench's first-accepted check rank estimates by their geomean over the generations; a
    config 5% ahead on v5e and 37% behind on v6e no longer wins on the first generation alone."""
    from maxkernel.bench import TaskRow, kept_first
    from maxkernel.nodes.common import better
    from maxkernel.nodes.finalize import accepted_milestones
    from maxkernel.state import Attempt

    def att(v5e: float | None, v6e: float | None = None, *, gens: bool = True) -> Attempt:
        by_gen = {"v5e": v5e, "v6e": v6e} if gens else {}
        return Attempt(iteration=1, kind="tune", source_hash=f"h{v5e}{v6e}{gens}", source_path="",
                       stage="accepted", accepted=True, estimated_speedup=v5e,
                       estimated_speedup_by_generation=by_gen)  # fmt: skip

    lopsided, even = att(1.10, 0.60), att(1.05, 0.95)
    assert better(even, lopsided) and not better(lopsided, even)
    assert even.score()[1] == pytest.approx((1.05 * 0.95) ** 0.5)
    assert even.score_text() == "estimated 1.00x geomean (v5e 1.05x, v6e 0.95x)"
    assert even.estimate_text() == "estimated v5e 1.05x, v6e 0.95x"
    # One generation, or one missing its estimate: the first generation's figure, as before.
    assert att(1.3, gens=False).score()[1] == 1.3 and att(1.3, gens=False).score_text() == "estimated 1.30x"
    assert att(1.3, None).score()[1] == 1.3
    # The milestones carry every generation, and the bench compares like with like.
    assert accepted_milestones([lopsided])["first_accepted"]["estimated_speedup_by_generation"] == {
        "v5e": 1.10,
        "v6e": 0.60,
    }

    def row(first: dict[str, float], final: dict[str, float]) -> TaskRow:
        return TaskRow(task_id="t", correct=True, estimated_speedup=final["v5e"], estimated_speedup_by_generation=final,
                       first_accepted_estimated_speedup=first["v5e"],
                       first_accepted_estimated_speedup_by_generation=first)  # fmt: skip

    assert (
        kept_first(row({"v5e": 1.10, "v6e": 0.60}, {"v5e": 1.05, "v6e": 0.95})) is True
    )  # v5e dipped, geomean up
    assert kept_first(row({"v5e": 1.05, "v6e": 0.95}, {"v5e": 1.10, "v6e": 0.60})) is False
    old = TaskRow(task_id="t", correct=True, estimated_speedup=1.2, estimated_speedup_by_generation={"v5e": 1.2},
                  first_accepted_estimated_speedup=1.1)  # fmt: skip
    assert kept_first(old) is True  # a result.json from before: first generation against first generation


def test_the_bench_skips_the_profile_trace_only_for_the_offline_author(tmp_path: Path) -> None:
    """The profile step traces the best kernel on the CPU for a model to reflect on; the offline author
    never reads it, so its bench runs pass --no-profile (~8% of a suite bench), a model's keep it."""
    from maxkernel.bench import Bench, BenchSettings

    def command(model: str, algorithm: str | None) -> list[str]:
        settings = BenchSettings(suite=str(tmp_path), out_dir=str(tmp_path / "o"), model=model,
                                 algorithm=algorithm)  # fmt: skip
        return Bench(settings)._command(tmp_path / "task", "thread", tmp_path / "out")

    assert "--no-profile" in command("offline", None) and "--no-profile" in command("offline", "parallel")
    assert "--no-profile" not in command("openai:gpt-5", None)


def test_order_from_runs_the_longest_tasks_first(tmp_path: Path, monkeypatch) -> None:
    """With --order-from an earlier bench's results, tasks start longest first (untimed ones after, in name
    order), so with several jobs the run does not end on one long task running alone."""
    import sqlite_utils

    from maxkernel.bench import Bench, BenchSettings, TaskRow

    suite = tmp_path / "suite"
    for name in ("a_quick", "b_slow", "c_untimed", "d_mid"):
        (suite / name).mkdir(parents=True)
        (suite / name / "reference.py").write_text("def computation(x):\n    return x\n")
    past = tmp_path / "past"
    past.mkdir()
    sqlite_utils.Database(past / "results.db")["results"].insert_all(
        [{"task_id": "a_quick", "seconds": "12.0"}, {"task_id": "b_slow", "seconds": "900.5"},
         {"task_id": "d_mid", "seconds": "80"}, {"task_id": "gone", "seconds": "5000"}]
    )  # fmt: skip
    started: list[str] = []

    def fake_one(self, task):
        started.append(task.name)
        return TaskRow(task_id=task.name, status="succeeded", seconds=1.0)

    monkeypatch.setattr(Bench, "_run_one", fake_one)
    said: list[str] = []
    settings = BenchSettings(suite=str(suite), out_dir=str(tmp_path / "o"), order_from=str(past))
    Bench(settings, on_progress=said.append).run()
    assert started == ["b_slow", "d_mid", "a_quick", "c_untimed"]
    assert any("longest first" in m and "3 of 4 tasks timed there" in m for m in said)

    plain: list[str] = []
    monkeypatch.setattr(Bench, "_run_one", lambda self, t: plain.append(t.name) or TaskRow(task_id=t.name))
    Bench(BenchSettings(suite=str(suite), out_dir=str(tmp_path / "o2")), on_progress=said.append).run()
    assert plain == ["a_quick", "b_slow", "c_untimed", "d_mid"]
    with pytest.raises(FileNotFoundError, match="no bench results"):
        Bench(BenchSettings(suite=str(suite), out_dir=str(tmp_path / "o3"), order_from=str(tmp_path / "nope")),
              on_progress=said.append).run()  # fmt: skip
