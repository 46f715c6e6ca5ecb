"""The profile tool (`tools/profiling.py`): one sandboxed run that traces the reference and the interpreted
candidate and estimates both per TPU generation."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from maxkernel.tools import profiling
from maxkernel.tools.harness import EvalOptions, evaluate
from maxkernel.tools.results import EvalResult
from maxkernel.tools.store import ResultsStore
from maxkernel.tools.tasks import load_task

DATA = Path(__file__).parent / "data"


def test_the_profile_shows_the_harness_estimates(tmp_path: Path) -> None:
    """The profile traces both programs in a sandboxed process and takes its TPU estimates from the harness
    (the reference's from the judge, the kernel's block model audited against what it ships): the same
    figures `evaluate` reached, served from the store, not a second computation in the profiling process."""
    task = load_task(DATA / "tasks" / "small_matmul", work_dir=tmp_path)
    source = (DATA / "candidates" / "good_matmul.py").read_text()
    store = ResultsStore(tmp_path / "results.db")
    options = EvalOptions(tpu=["v5e"], allow_unsandboxed=True)
    judged = evaluate(task, source, options, store=store, work_dir=tmp_path / "work")
    assert judged.accepted and judged.estimate is not None and judged.estimate.estimated_speedup
    report = profiling.profile_kernel(
        task, source, ["v5e"], tmp_path / "work", repeats=1, store=store, evaluate_options=options
    )
    assert report.error is None, report.error
    assert report.reference is not None and report.candidate is not None
    est = report.estimates["v5e"]
    assert est.estimated_seconds == judged.estimate.estimated_seconds
    assert est.reference_estimated_seconds == judged.estimate.reference_estimated_seconds
    assert "Estimated by the harness" in report.to_markdown()


def test_a_forged_estimate_does_not_reach_the_profile(tmp_path: Path) -> None:
    """A candidate that rewrites the block model in its own process (claims ~1000x less time) used to have
    its claim printed by `maxkernel profile` and handed to the reflect step: the profiling process computed
    the estimates after loading it. Now the profile shows what the harness decided: estimate withheld."""
    if not shutil.which("bwrap"):
        pytest.skip("bubblewrap is not installed")
    task = load_task(DATA / "tasks" / "small_matmul", work_dir=tmp_path)
    source = (DATA / "hostile" / "forge_estimate.py").read_text()
    report = profiling.profile_kernel(
        task, source, ["v5e"], tmp_path / "work", repeats=1, evaluate_options=EvalOptions(tpu=["v5e"])
    )
    assert report.error is None, report.error
    est = report.estimates["v5e"]
    assert est.estimated_seconds is None and est.estimated_speedup is None
    assert est.note and "withheld" in est.note
    assert est.reference_estimated_seconds  # the judge's figure for the reference stays


def test_an_unchanged_kernel_is_profiled_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A round without gain keeps the same best kernel: its profile is the one already taken, not a new
    sandboxed run. Another kernel, another generation or a failed profile is run (again)."""
    task = load_task(DATA / "tasks" / "small_matmul", work_dir=tmp_path)
    monkeypatch.setattr(profiling, "PROFILE_SUMMARIES", profiling._Summaries())
    runs: list[tuple[str, list[str]]] = []
    fail = {"now": False}

    judged = EvalResult(task_id=task.task_id, source_hash="h")  # what the node evaluated: passed through

    def fake_profile(task, source, tpu, work_dir, *, repeats=3, evaluation=None):  # noqa: ANN001, ANN202
        assert evaluation is judged  # the summary never evaluates on its own
        runs.append((source, tpu))
        err = "timeout: the sandbox was killed" if fail["now"] else None
        return profiling.ProfileReport(task_id=task.task_id, error=err)

    monkeypatch.setattr(profiling, "profile_kernel", fake_profile)
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("# kernel a\n")
    b.write_text("# kernel b\n")
    first = profiling.profile_summary(task, str(a), ["v5e"], tmp_path, judged)
    assert profiling.profile_summary(task, str(a), ["v5e", "v6e"], tmp_path, judged) == first
    assert len(runs) == 1
    profiling.profile_summary(task, str(b), ["v5e"], tmp_path, judged)
    profiling.profile_summary(task, str(a), ["v6e"], tmp_path, judged)
    assert runs[1:] == [("# kernel b\n", ["v5e"]), ("# kernel a\n", ["v6e"])]
    fail["now"] = True
    c = tmp_path / "c.py"
    c.write_text("# kernel c\n")
    assert "profiling failed" in profiling.profile_summary(task, str(c), ["v5e"], tmp_path, judged)
    fail["now"] = False
    profiling.profile_summary(task, str(c), ["v5e"], tmp_path, judged)
    assert len(runs) == 5  # the failure was not kept
