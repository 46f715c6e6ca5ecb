"""Tasks and runs around the harness: path-safe task ids, refused side-effecting references, derived
timeouts, unreadable kernels, thread leases, and what a killed run leaves in its output dir."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from maxkernel.tools.harness import TIMEOUT_CEILING_S, TIMEOUT_FLOOR_S, EvalOptions, default_timeout
from maxkernel.tools.tasks import KernelTask, TaskError, load_task, safe_task_id


@pytest.fixture(scope="module")
def matmul_task(data_dir: Path, session_work: Path) -> KernelTask:
    return load_task(data_dir / "tasks" / "small_matmul", work_dir=session_work)


@pytest.mark.parametrize(
    ("raw", "safe"),
    [
        ("../../x", "_.._x"),
        ("a/b", "a_b"),
        ("..", "task"),
        ("ok-id_1.2", "ok-id_1.2"),
        ("/etc/passwd", "_etc_passwd"),
    ],
)
def test_task_ids_are_one_path_component(raw: str, safe: str) -> None:
    assert safe_task_id(raw) == safe
    assert "/" not in safe_task_id(raw) and not safe_task_id(raw).startswith(".")


def test_task_yaml_cannot_move_outputs(data_dir: Path, tmp_path: Path, session_work: Path) -> None:
    task = tmp_path / "evil"
    shutil.copytree(data_dir / "tasks" / "small_matmul", task)
    yaml = (task / "kernel_task.yaml").read_text()
    (task / "kernel_task.yaml").write_text(yaml.replace("task_id: small_matmul", "task_id: ../../x"))
    kt = load_task(task, work_dir=session_work)
    assert kt.task_id == "_.._x"
    assert (Path("out") / kt.task_id).resolve().parent == Path("out").resolve()


def test_reference_with_import_side_effect_is_a_bad_task(data_dir: Path, tmp_path: Path) -> None:
    task = tmp_path / "side_effect"
    shutil.copytree(data_dir / "tasks" / "small_matmul", task)
    ref = (task / "reference.py").read_text()
    (task / "reference.py").write_text(
        "import socket\nsocket.socket(socket.AF_INET).connect(('10.0.0.1', 9))\n" + ref
    )
    with pytest.raises(TaskError, match="sandbox forbids"):
        load_task(task, work_dir=tmp_path / "work")


def test_default_timeout_is_derived_from_the_task(matmul_task: KernelTask) -> None:
    t = default_timeout(matmul_task, EvalOptions(tpu=["v5e"]), load_factor=1.0)
    assert TIMEOUT_FLOOR_S <= t < TIMEOUT_CEILING_S  # a hang costs about a minute, not ten
    # a loaded machine stretches every stage alike: the limit grows with it, up to the ceiling
    busy = default_timeout(matmul_task, EvalOptions(tpu=["v5e"]), load_factor=4.0)
    assert busy > t and busy <= TIMEOUT_CEILING_S
    slow = matmul_task.model_copy(update={"reference_seconds": 1000.0})
    assert default_timeout(slow, EvalOptions()) == TIMEOUT_CEILING_S


def test_the_judge_gets_time_for_the_reference_estimates_it_must_compute(
    matmul_task: KernelTask, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiler's estimate of the reference at the task's own shapes is one XLA compile per generation
    (minutes for a large conv under load): while it is not cached the judge, and only the judge, gets
    REFERENCE_ESTIMATE_BUDGET_S per generation on top of the evaluation's timeout."""
    from maxkernel.tools import harness

    class Built(Exception):
        pass

    limits: dict[str, float] = {}
    real = harness.SandboxedChild

    def capture(target: str, payload: dict, run_dir: Path, lim, **kw):
        limits[target.rsplit(":", 1)[1]] = lim.timeout_s
        if len(limits) == 2:
            raise Built
        return real(target, payload, run_dir, lim, **kw)

    monkeypatch.setattr(harness, "SandboxedChild", capture)
    monkeypatch.setattr(harness, "machine_load_factor", lambda: 1.0)
    opts = EvalOptions(tpu=["v5e", "v6e"])
    for i, cached in enumerate(({}, {"v5e": 1e-3}, {"v5e": 1e-3, "v6e": 1e-3})):
        limits.clear()
        (tmp_path / str(i)).mkdir()
        with pytest.raises(Built):
            harness._run(matmul_task, "x = 1\n", "h", opts, 100.0, tmp_path / str(i), cached)
        extra = harness.REFERENCE_ESTIMATE_BUDGET_S * (2 - len(cached))
        assert limits == {"judge_job": 100.0 + extra, "candidate_job": 100.0}


def test_binary_kernel_is_a_clean_exit_1(data_dir: Path, tmp_path: Path) -> None:
    from maxkernel.cli import app

    kernel = tmp_path / "garbage.py"
    kernel.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x00" * 10)
    r = CliRunner().invoke(app, ["eval", str(data_dir / "tasks" / "small_matmul"), str(kernel),
                                 "--work-dir", str(tmp_path / "w"), "--store", str(tmp_path / "r.db")])  # fmt: skip
    assert r.exit_code == 1, r.output
    assert "UTF-8" in r.output and "Traceback" not in r.output


def test_second_resume_of_a_thread_refuses(tmp_path: Path) -> None:
    from maxkernel.runs import RunBusy, take_lease
    from maxkernel.tools.store import ResultsStore

    store = ResultsStore(tmp_path / "results.db")
    lock = tmp_path / "leases" / "mk-test.lock"
    lock.parent.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl,sys,time; f=open(sys.argv[1],'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
         "f.write('pid holder'); f.flush(); print('held', flush=True); time.sleep(60)", str(lock)],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
        with pytest.raises(RunBusy, match="pid holder"):
            take_lease(store, "mk-test")
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 10
    while True:  # once the holder is gone, the lease is free again
        try:
            take_lease(store, "mk-test")
            break
        except RunBusy:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_killed_synthesize_leaves_a_result(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    import maxkernel.cli as cli

    def killed(*_a: object, **_k: object) -> None:
        raise KeyboardInterrupt

    import maxkernel.nodes.common as nodes_common

    monkeypatch.setattr(nodes_common, "evaluate", killed)  # synthesize evaluates through the graph's nodes
    out = tmp_path / "out"
    CliRunner().invoke(cli.app, ["synthesize", str(data_dir / "tasks" / "small_matmul"), "--out", str(out),
                                 "--work-dir", str(tmp_path / "w"), "--store", str(tmp_path / "r.db")])  # fmt: skip
    assert (out / "kernel.py").exists()
    result = json.loads((out / "result.json").read_text())
    assert "no verdict yet" in result["status"] and result["accepted"] is False


def test_synthesize_repairs_through_the_agent_graph(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`synthesize --repairs 1` is one round of the agent graph: a rejected kernel goes to the graph's repair
    node once, and result.json reports the last verdict."""
    import json

    import maxkernel.cli as cli
    import maxkernel.nodes.common as nodes_common
    from maxkernel.tools.results import EvalResult, StageError

    sources: list[str] = []

    def rejects(task: KernelTask, source: str, *_a: object, **_k: object) -> EvalResult:
        sources.append(source)
        error = StageError(stage="compile", message=f"RESOURCE_EXHAUSTED: scoped VMEM ({len(sources)})")
        return EvalResult(task_id=task.task_id, source_hash=str(len(sources)), error=error)

    monkeypatch.setattr(nodes_common, "evaluate", rejects)
    out = tmp_path / "out"
    res = CliRunner().invoke(cli.app, ["synthesize", str(data_dir / "tasks" / "small_matmul"), "--out", str(out),
                                       "--repairs", "1", "--work-dir", str(tmp_path / "w"),
                                       "--store", str(tmp_path / "r.db")])  # fmt: skip
    assert res.exit_code == 1, res.output
    assert len(sources) == 2 and sources[0] != sources[1]  # the repaired kernel is a different one
    assert (out / "kernel.py").read_text() == sources[1]
    result = json.loads((out / "result.json").read_text())
    assert (
        result["status"] == "finished" and result["error"]["message"] == "RESOURCE_EXHAUSTED: scoped VMEM (2)"
    )
    assert {p.name for p in out.iterdir()} == {"kernel.py", "plan.md", "result.json"}


def test_a_judge_dying_in_its_compile_stage_is_the_candidates_compile_failure() -> None:
    """The judge compiles the candidate's TPU program in its compile stage: running out of memory or time
    there is that program's compile failure (the author can repair it), not a dead task. Before, an MoE
    kernel whose Mosaic compile needed over 12 GB came back "the judge (reference) failed" on every try."""
    from maxkernel.tools.harness import _judge_failure
    from maxkernel.tools.results import STAGE_INFO, EvalResult
    from maxkernel.tools.sandbox import SandboxOutcome

    oom = "F1201 low_level_alloc.cc:625] RAW: mmap error: 12"
    died = SandboxOutcome(
        ok=False, stage="compile", error=f"process killed by SIGSEGV: {oom}", stderr_tail=oom
    )
    r = _judge_failure(EvalResult(task_id="t", source_hash="h"), died, 12_000)
    assert r.error.stage == "compile" and not r.accepted and STAGE_INFO["compile"].compile_class
    assert "ran out of memory (the evaluation's memory limit is 12000 MB)" in r.error.message

    slow = SandboxOutcome(ok=False, stage="compile", timed_out=True, error="timed out after 600 s")
    r = _judge_failure(EvalResult(task_id="t", source_hash="h"), slow, 12_000)
    assert r.error.stage == "compile" and "did not finish in time" in r.error.message

    # Its warm-up (the reference's compiler estimate) running out of time is the loaded machine's doing:
    # reported precisely, never stored as the candidate's verdict.
    warm = SandboxOutcome(ok=False, stage="inputs_ready", timed_out=True, error="timed out after 120 s")
    r = _judge_failure(EvalResult(task_id="t", source_hash="h"), warm, 12_000)
    assert (
        r.error.stage == "infrastructure" and "XLA cost estimate at the task's own shapes" in r.error.message
    )
    assert not STAGE_INFO[r.error.stage].cached
    # After it the judge runs the candidate's checked programs: too slow or too large there is the
    # candidate's correctness failure (repairable), not the task's (a paged-attention kernel of 2-token
    # pages was reported as "the judge did not finish the reference in time").
    for run in (
        SandboxOutcome(ok=False, stage="judge_run", timed_out=True, error="timed out after 649 s"),
        SandboxOutcome(ok=False, stage="judge_run", error=f"killed: {oom}", stderr_tail=oom),
    ):
        r = _judge_failure(EvalResult(task_id="t", source_hash="h"), run, 12_000)
        assert r.error.stage == "correctness" and "candidate's checked program" in r.error.message
        assert "reference" not in r.error.message
    # Before that the judge runs the task's code: the task's failure.
    ref_slow = SandboxOutcome(ok=False, stage="reference", timed_out=True, error="timed out after 120 s")
    r = _judge_failure(EvalResult(task_id="t", source_hash="h"), ref_slow, 12_000)
    assert r.error.stage == "task" and "did not finish the reference in time" in r.error.message
    ref = SandboxOutcome(
        ok=False, stage="reference", error=f"process killed by SIGSEGV: {oom}", stderr_tail=oom
    )
    r = _judge_failure(EvalResult(task_id="t", source_hash="h"), ref, 12_000)
    assert r.error.stage == "task" and "ran out of memory" in r.error.message
