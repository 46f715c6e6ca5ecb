"""The zygote (`maxkernel.tools.zygote`): one pre-imported process forks every sandboxed job, so what a job
leaves behind must die with it, other jobs' run dirs must stay out of its sight, and a changed toolchain must
start a new zygote rather than fork stale code."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from maxkernel.tools import sandbox
from maxkernel.tools.sandbox import SandboxedChild, SandboxLimits, SandboxOutcome, fresh_run_dir
from maxkernel.tools.zygote import POOL

pytestmark = pytest.mark.skipif(sandbox.isolation_available() != "bubblewrap", reason="needs bubblewrap")
PROBE = "maxkernel.tools.zygote:probe_job"


@pytest.fixture(scope="module")
def zroot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zygote") / "evals"


def job(zroot: Path, payload: dict[str, object]) -> tuple[SandboxedChild, SandboxOutcome]:
    child = SandboxedChild(PROBE, payload, fresh_run_dir(zroot, "probe"), SandboxLimits(timeout_s=180),
                           zygote_root=zroot)  # fmt: skip
    child.start()
    return child, child.wait()


def test_state_a_job_leaves_behind_never_reaches_the_next(zroot: Path) -> None:
    first, out = job(zroot, {"leave_state": True})
    assert first.via_zygote and out.ok, out.error or out.stderr_tail
    assert out.value is not None
    assert out.value["backends_before"] == 0  # the zygote forked without a JAX backend
    assert out.value["optional_imports_settled"] is True  # a missing optional module is not retried per job
    assert out.value["wrote_beside_run_dir"] is False  # the run dir's folder is not the job's to write
    pids = POOL.pids()

    second, out = job(zroot, {})
    assert second.via_zygote and out.ok, out.error or out.stderr_tail
    assert POOL.pids() == pids  # the same zygote forked both
    facts = out.value
    assert facts is not None
    assert "left_behind" not in facts["tmp"]  # the first job's /tmp file is gone
    assert facts["global_left"] is None  # its module global too
    assert facts["jnp_add_patched"] is False and facts["sum"] == 3.0  # and its monkeypatched JAX
    assert facts["siblings"] == [second.run_dir.name]  # other jobs' run dirs are hidden
    assert facts["pid"] == 1  # its own pid namespace: no other job to signal or trace
    if os.geteuid() == 0:
        assert facts["uid"] == 65534
    assert (first.run_dir / "progress.jsonl").exists()  # each job wrote in its own run dir, on the host


def test_a_toolchain_change_starts_a_new_zygote(zroot: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    child, out = job(zroot, {})
    assert child.via_zygote and out.ok, out.error
    before = POOL.pids()
    monkeypatch.setattr(sandbox, "toolchain_fingerprint", lambda: "another-jax-or-another-maxkernel")
    child, out = job(zroot, {})
    assert child.via_zygote and out.ok, out.error
    after = POOL.pids()
    assert after and after[-1] not in before  # forked by a new zygote
    assert not set(before) & set(after)  # and the stale one was closed


def test_no_zygote_falls_back_to_spawning(zroot: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"  # a run dir outside the zygote's root cannot be forked there
    child = SandboxedChild(PROBE, {}, fresh_run_dir(outside, "probe"), SandboxLimits(timeout_s=180),
                           zygote_root=zroot)  # fmt: skip
    child.start()
    out = child.wait()
    assert not child.via_zygote and out.ok, out.error
    assert out.value is not None and out.value["sum"] == 3.0


def test_read_paths_under_tmp_stay_visible_and_read_only(zroot: Path, tmp_path: Path) -> None:
    """Each job gets a fresh /tmp; a task (or a whole checkout, as in CI) living under /tmp must still be
    there, read-only: hiding it made every evaluation of such a task fail to import its reference."""
    task = Path("/tmp") / f"maxkernel-zygote-task-{os.getpid()}"
    task.mkdir(exist_ok=True)
    try:
        (task / "reference.py").write_text("ANSWER = 42\n")
        if os.geteuid() == 0:
            os.chmod(task, 0o755)
        child = SandboxedChild(PROBE, {"read": str(task / "reference.py")}, fresh_run_dir(zroot, "probe"),
                               SandboxLimits(timeout_s=180), read_paths=[task], zygote_root=zroot)  # fmt: skip
        child.start()
        out = child.wait()
        assert child.via_zygote and out.ok, out.error or out.stderr_tail
        assert out.value is not None
        assert out.value["read"] == "ANSWER = 42\n"
        assert out.value["read_writable"] is False
        assert (task / "reference.py").read_text() == "ANSWER = 42\n"
    finally:
        for f in task.iterdir():
            f.unlink()
        task.rmdir()


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(p))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def test_a_closed_zygote_leaves_no_process_behind(zroot: Path) -> None:
    """Closing the pool ends every zygote and its bubblewrap: the reader thread blocked on the control
    socket once kept it open, and each closed zygote stayed behind (a test run piled up ~100 of them)."""
    child, out = job(zroot, {})
    assert child.via_zygote and out.ok, out.error
    tree = set(POOL.pids())
    for pid in list(tree):
        tree |= _descendants(pid)
    assert len(tree) >= 2  # bubblewrap and the zygote under it
    POOL.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in tree):
        time.sleep(0.2)
    alive = [p for p in tree if Path(f"/proc/{p}").exists() and "Z" not in _state(p)]
    assert not alive


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def test_a_killed_job_has_stopped_writing_when_kill_returns(zroot: Path) -> None:
    """The harness deletes a run dir right after killing its jobs; a job's processes that outlived the kill
    by a moment kept writing into it, and the deleted run dir came back (a CI run left one behind)."""
    from maxkernel.tools.readback import remove_tree

    child = SandboxedChild(PROBE, {"scribble": True}, fresh_run_dir(zroot, "probe"),
                           SandboxLimits(timeout_s=180), zygote_root=zroot)  # fmt: skip
    child.start()
    assert child.via_zygote
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
        any(child.run_dir.glob("child-*")) and any(child.run_dir.glob("parent-*"))
    ):
        time.sleep(0.05)
    assert any(child.run_dir.glob("child-*")), "the job never started writing"
    child.kill()
    assert child.proc is not None and child.proc.poll() is not None
    remove_tree(child.run_dir)
    time.sleep(1.0)
    assert not child.run_dir.exists()


def test_a_zygotes_log_has_no_name_and_says_why_it_did_not_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log file in /tmp outlives an agent killed before close() (they piled up in CI's /tmp), so the
    zygote's stderr goes to a file with no name; it is still the clue when the zygote dies at start-up."""
    import sys
    import tempfile

    from maxkernel.tools.zygote import Zygote, ZygoteError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = tmp_path / "root"
    # Stands in for the zygote: says hello on the control socket (its fd is argv[5] after `-c`), then
    # waits for the socket's end.
    fake = ("import json, os, socket, sys; s = socket.socket(fileno=int(sys.argv[5])); "
            "s.send(json.dumps({'pid': os.getpid(), 'backends': 0}).encode()); s.recv(10)")  # fmt: skip
    zygote = Zygote([sys.executable, "-c", fake], dict(os.environ), root, ())
    try:
        assert zygote.alive()
        assert list(tmp_path.iterdir()) == []
    finally:
        zygote.close()
    dies = [sys.executable, "-c", "import sys; sys.stderr.write('no libtpu here'); sys.exit(3)"]
    with pytest.raises(ZygoteError, match="did not start: no libtpu here"):
        Zygote(dies, dict(os.environ), root, ())
    assert list(tmp_path.iterdir()) == []
