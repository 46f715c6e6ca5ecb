"""Hostile candidates, one per attack class of issue 10: each must end rejected, or contained (nothing left
on the host), under bubblewrap and, where it applies, in the fallback mode (no bubblewrap).

The fallback cases drop the child to `nobody`, which needs a root agent; as a normal user the fallback
cannot keep a candidate from same-user files and processes (README, harness section), so those cases are
skipped there rather than asserted.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from maxkernel.tools.harness import EvalOptions, evaluate
from maxkernel.tools.results import EvalResult
from maxkernel.tools.store import ResultsStore
from maxkernel.tools.tasks import KernelTask, load_task

HOSTILE = Path(__file__).parent / "data" / "hostile"
OPTS = EvalOptions(tpu=["v5e"], timeout_s=120, estimate=False)
FALLBACK_OPTS = OPTS.model_copy(update={"allow_unsandboxed": True})
ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def task(data_dir: Path, session_work: Path) -> KernelTask:
    return load_task(data_dir / "tasks" / "small_matmul", work_dir=session_work)


@pytest.fixture(params=["bubblewrap", "fallback"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "fallback":
        from maxkernel.tools import sandbox

        if not ROOT:
            pytest.skip("the fallback drops to nobody only for a root agent; see the README")
        if sandbox.fallback_unreadable():
            pytest.skip(sandbox.fallback_unreadable())
        monkeypatch.setattr(sandbox, "bubblewrap_path", lambda: None)
    elif not __import__("shutil").which("bwrap"):
        pytest.skip("bubblewrap is not installed")
    return request.param


def run(task: KernelTask, name: str, work: Path, mode: str, store: ResultsStore | None = None) -> EvalResult:
    r = evaluate(task, (HOSTILE / name).read_text(), FALLBACK_OPTS if mode == "fallback" else OPTS,
                 store=store, work_dir=work)  # fmt: skip
    assert r.isolation == mode
    assert not (work / "evals").exists() or not list((work / "evals").iterdir())  # run dirs cleaned
    return r


# Rejected outright: (candidate, stages it may end in, modes it runs in by default).
REJECTED = [
    ("patch_comparison.py", {"correctness"}),
    ("patch_pallas_check.py", {"pallas"}),
    ("stack_walk.py", {"correctness"}),
    ("steal_key.py", {"load", "sandbox"}),
    ("rewrite_reference.py", {"correctness"}),
    ("lookup_table.py", {"correctness"}),
    ("dead_branch.py", {"pallas"}),
    ("interpret_branch.py", {"consistency", "correctness", "pallas"}),
    ("shape_branch.py", {"consistency", "pallas"}),
    ("huge_stderr.py", {"load", "sandbox"}),
    ("dir_replace.py", {"sandbox", "correctness"}),
    ("flood.py", {"load", "sandbox"}),
]
FAST_IN_FALLBACK = {"patch_comparison.py", "rewrite_reference.py", "steal_key.py"}


@pytest.mark.parametrize(
    ("name", "stages"),
    [pytest.param(n, s, id=n) for n, s in REJECTED],
)
def test_bubblewrap_rejects(task: KernelTask, tmp_path: Path, name: str, stages: set[str]) -> None:
    if not __import__("shutil").which("bwrap"):
        pytest.skip("bubblewrap is not installed")
    r = run(task, name, tmp_path, "bubblewrap")
    assert not r.accepted
    assert r.error is not None and r.error.stage in stages, r.error


@pytest.mark.parametrize(
    ("name", "stages"),
    [pytest.param(n, s, id=n, marks=() if n in FAST_IN_FALLBACK else pytest.mark.slow) for n, s in REJECTED],
)
def test_fallback_rejects(
    task: KernelTask, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, stages: set[str]
) -> None:
    from maxkernel.tools import sandbox

    if not ROOT:
        pytest.skip("the fallback drops to nobody only for a root agent; see the README")
    if sandbox.fallback_unreadable():
        pytest.skip(sandbox.fallback_unreadable())
    monkeypatch.setattr(sandbox, "bubblewrap_path", lambda: None)
    r = run(task, name, tmp_path, "fallback")
    assert not r.accepted
    assert r.error is not None and r.error.stage in stages, r.error


def test_correct_only_at_the_validation_size_is_caught_at_the_larger_shape(
    task: KernelTask, tmp_path: Path
) -> None:
    """Same program at every shape (a Python-float scale picked by shape), right at the validation shapes:
    every other check accepts it; one secret input set at the larger check shape rejects it."""
    if not __import__("shutil").which("bwrap"):
        pytest.skip("bubblewrap is not installed")
    source = (HOSTILE / "larger_shape_branch.py").read_text()
    without = evaluate(task, source, OPTS.model_copy(update={"larger_shape": False}), work_dir=tmp_path)
    assert without.accepted, without.error  # what the larger-shape check exists for
    assert without.correctness.larger is None and without.correctness.larger_check == "skipped: not requested"
    r = run(task, "larger_shape_branch.py", tmp_path, "bubblewrap")
    assert not r.accepted and r.error is not None and r.error.stage == "correctness", r.error
    assert "at the larger check shape float32[256,512]" in r.error.message
    assert r.correctness.sets and all(s.ok for s in r.correctness.sets)  # right at the validation shapes
    assert r.correctness.larger is not None and not r.correctness.larger.ok
    assert r.correctness.interpret_modes == ["plain+tpu", "plain"]  # the judge's run at the larger shape


def test_a_forged_speed_estimate_is_withheld(task: KernelTask, tmp_path: Path) -> None:
    """The block model runs in the candidate's process; this one rewrites it to report a thousandth of the
    truth. The kernel itself is honest and correct, so it is accepted, but the judge's audit of the kernel
    it shipped contradicts the claim: no estimate, no speedup, and a warning saying why."""
    if not __import__("shutil").which("bwrap"):
        pytest.skip("bubblewrap is not installed")
    opts = OPTS.model_copy(update={"estimate": True, "tpu": ["v5e", "v6e"]})
    r = evaluate(task, (HOSTILE / "forge_estimate.py").read_text(), opts, work_dir=tmp_path)
    assert r.accepted, r.error
    assert r.estimate is not None and r.estimate.estimated_seconds is None
    assert r.estimate.estimated_speedup is None
    assert all(g.estimated_speedup is None for g in r.estimate.by_generation.values())
    assert r.estimate.reference_estimated_seconds  # the reference's side is the judge's: still there
    assert any("estimate withheld" in w and "shipped" in w for w in r.warnings), r.warnings


def test_huge_stderr_is_read_as_a_tail(task: KernelTask, tmp_path: Path) -> None:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = run(task, "huge_stderr.py", tmp_path, "bubblewrap")
    assert not r.accepted and len(r.error.message) < 5000
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 500_000  # KiB: no 2 GiB read


def test_read_shadow_leaks_nothing(task: KernelTask, tmp_path: Path, mode: str) -> None:
    r = run(task, "read_shadow.py", tmp_path, mode)
    assert r.error is not None and r.error.stage == "load"
    assert "root:" not in r.error.message and "SHADOW:" not in r.error.message


def test_proc_environ_leaks_no_key(
    task: KernelTask, tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GOOGLE_API_KEY", "sk-hostile-test-secret")
    r = run(task, "proc_environ.py", tmp_path, mode)
    assert r.error is not None and r.error.stage == "load"
    assert "ENV:" in r.error.message  # it did run and report what it saw ...
    assert "sk-hostile-test-secret" not in r.error.message  # ... which held no key


def test_unix_socket_on_the_host_is_unreachable(task: KernelTask, tmp_path: Path, mode: str) -> None:
    path = "/tmp/maxkernel_hostile_listener.sock"
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    listener.setblocking(False)
    try:
        run(task, "unix_socket.py", tmp_path, mode)
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
        os.unlink(path)


def test_ctypes_bypass_writes_nothing_on_the_host(task: KernelTask, tmp_path: Path, mode: str) -> None:
    markers = [
        Path("/root/maxkernel_ctypes_system_escape"),
        Path("/root/maxkernel_ctypes_open_escape"),
    ] + ([Path("/var/tmp/maxkernel_ctypes_system_escape")] if mode == "bubblewrap" else [])
    for m in markers:
        m.unlink(missing_ok=True)
    run(task, "ctypes_bypass.py", tmp_path, mode)
    assert not [m for m in markers if m.exists()]


def test_killing_the_parent_kills_nothing_of_ours(task: KernelTask, tmp_path: Path, mode: str) -> None:
    r = run(task, "kill_parent.py", tmp_path, mode)
    assert r.error is None or r.error.stage != "infrastructure"  # the judge survived to give a verdict
    os.kill(os.getpid(), 0)  # and so did we


def _pooled_zygote(pid: str, cmdline: bytes) -> bool:
    """A zygote the agent keeps for the next job (its bubblewrap, and the zygote bubblewrap starts): not a
    leftover. The zygote's forks (a job's middle, the job, anything the job left) are."""
    if b"maxkernel.tools.zygote" not in cmdline:
        return False
    if Path(cmdline.split(b"\0")[0].decode()).name == "bwrap":
        return True
    try:
        ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        parent = Path(f"/proc/{ppid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return False
    return Path(parent.split(b"\0")[0].decode()).name == "bwrap"


def test_setsid_leftover_is_gone(task: KernelTask, tmp_path: Path, mode: str) -> None:
    run(task, "setsid_leftover.py", tmp_path, mode)
    leftovers = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(tmp_path).encode() in cmdline and not _pooled_zygote(pid, cmdline):
            leftovers.append((pid, cmdline[:200]))
    assert not leftovers


def test_rewriting_the_store_changes_no_verdict(task: KernelTask, tmp_path: Path, mode: str) -> None:
    store = ResultsStore(tmp_path / "results.db")
    first = run(task, "rewrite_store.py", tmp_path, mode, store=store)
    assert not first.accepted and first.error.stage not in ("infrastructure", "sandbox")
    again = run(task, "rewrite_store.py", tmp_path, mode, store=store)
    assert again.cached and not again.accepted


def test_model_written_candidates_refuse_the_fallback(
    task: KernelTask, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from maxkernel.tools import sandbox

    monkeypatch.setattr(sandbox, "bubblewrap_path", lambda: None)
    store = ResultsStore(tmp_path / "results.db")
    source = (Path(__file__).parent / "data" / "candidates" / "good_matmul.py").read_text()
    r = evaluate(task, source, OPTS, store=store, work_dir=tmp_path)
    assert r.error is not None and r.error.stage == "infrastructure"
    assert "allow-unsandboxed" in r.error.message
    assert store.count_evaluations() == 0  # not a verdict: never stored


def test_infrastructure_failures_are_not_cached(
    task: KernelTask, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from maxkernel.tools import sandbox

    monkeypatch.setattr(sandbox, "_package_root", lambda: tmp_path / "no_such_checkout")
    store = ResultsStore(tmp_path / "results.db")
    source = (Path(__file__).parent / "data" / "candidates" / "good_matmul.py").read_text()
    r = evaluate(task, source, OPTS, store=store, work_dir=tmp_path)
    assert r.error is not None and r.error.stage == "infrastructure", r.error
    assert store.count_evaluations() == 0
    monkeypatch.undo()
    good = evaluate(task, source, OPTS, store=store, work_dir=tmp_path)
    assert good.accepted and not good.cached
