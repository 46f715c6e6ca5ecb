"""The profile tool (`tools/profiling.py`): one sandboxed run that traces the reference and the interpreted
candidate and estimates both per TPU generation."""

from __future__ import annotations

from pathlib import Path

import pytest

from maxkernel.tools import profiling
from maxkernel.tools.reference_cache import ReferenceEstimates
from maxkernel.tools.tasks import load_task

DATA = Path(__file__).parent / "data"


def test_profile_reuses_the_reference_estimate_the_harness_computed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent profiles the kernel it has just evaluated: the reference's compiler estimate (an XLA
    compile at the task's own shapes, seconds to a minute per generation) is already known to this process
    and is not compiled again. A figure no compile of this reference gives shows which one was used."""
    task = load_task(DATA / "tasks" / "small_matmul", work_dir=tmp_path)
    known = ReferenceEstimates()  # this test's own, so no other test sees the made-up figure
    monkeypatch.setattr(profiling, "REFERENCE_ESTIMATES", known)
    sentinel = 1.25e-3  # the compiler's estimate of this reference is ~3e-5 s on v5e
    known.put(task, "v5e", sentinel)
    source = (DATA / "candidates" / "good_matmul.py").read_text()
    report = profiling.profile_kernel(task, source, ["v5e"], tmp_path / "work", repeats=1)
    assert report.error is None, report.error
    assert report.reference is not None and report.candidate is not None
    est = report.estimates["v5e"]
    assert est.reference_estimated_seconds == sentinel
    assert est.estimated_seconds and est.estimated_seconds > 0  # the candidate's block model still ran
    assert est.estimated_speedup == pytest.approx(sentinel / est.estimated_seconds, rel=1e-3)


def test_an_unchanged_kernel_is_profiled_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A round without gain keeps the same best kernel: its profile is the one already taken, not a new
    sandboxed run. Another kernel, another generation or a failed profile is run (again)."""
    task = load_task(DATA / "tasks" / "small_matmul", work_dir=tmp_path)
    monkeypatch.setattr(profiling, "PROFILE_SUMMARIES", profiling._Summaries())
    runs: list[tuple[str, list[str]]] = []
    fail = {"now": False}

    def fake_profile(task, source, tpu, work_dir, *, repeats=3):  # noqa: ANN001, ANN202
        runs.append((source, tpu))
        err = "timeout: the sandbox was killed" if fail["now"] else None
        return profiling.ProfileReport(task_id=task.task_id, error=err)

    monkeypatch.setattr(profiling, "profile_kernel", fake_profile)
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("# kernel a\n")
    b.write_text("# kernel b\n")
    first = profiling.profile_summary(task, str(a), ["v5e"], tmp_path)
    assert profiling.profile_summary(task, str(a), ["v5e", "v6e"], tmp_path) == first
    assert len(runs) == 1
    profiling.profile_summary(task, str(b), ["v5e"], tmp_path)
    profiling.profile_summary(task, str(a), ["v6e"], tmp_path)
    assert runs[1:] == [("# kernel b\n", ["v5e"]), ("# kernel a\n", ["v6e"])]
    fail["now"] = True
    c = tmp_path / "c.py"
    c.write_text("# kernel c\n")
    assert "profiling failed" in profiling.profile_summary(task, str(c), ["v5e"], tmp_path)
    fail["now"] = False
    profiling.profile_summary(task, str(c), ["v5e"], tmp_path)
    assert len(runs) == 5  # the failure was not kept
