"""Run untrusted code (candidate kernels, task references) in a child process and get JSON back.

The child is `python -m maxkernel.tools.worker RUN_DIR`, started under bubblewrap when it is installed
(no network, read-only file system except the run directory, private /tmp, dies with its parent) and
always with a wall-clock timeout and an address-space limit. Inside, the worker also installs an audit
hook that refuses sockets, subprocesses and writes outside the run directory, so a violation is reported
by name even on machines without bubblewrap.

Nothing here raises for anything the child does: a hang, a crash, `os._exit`, an exception or an escape
attempt all come back as a `SandboxOutcome` with the stage the child had reached.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from maxkernel.tools.worker import sign

log = logging.getLogger(__name__)

PROGRESS_FILE = "progress.jsonl"
RESULT_FILE = "result.json"
JOB_FILE = "job.json"

_warned_no_bwrap = False


class SandboxLimits(BaseModel):
    timeout_s: float = Field(600.0, description="wall-clock limit for the whole child process")
    memory_mb: int = Field(12_000, description="address-space limit (RLIMIT_AS); JAX reserves a lot of it")
    allow_device: bool = Field(
        False, description="pass accelerator device nodes through and let JAX use them (device timing)"
    )


class SandboxOutcome(BaseModel):
    """What happened to the child. `value` is the entry function's return value when it returned."""

    ok: bool
    value: dict[str, Any] | None = None
    stage: str | None = Field(None, description="last stage the child announced before it stopped")
    error: str | None = None
    returncode: int | None = None
    timed_out: bool = False
    violations: list[str] = Field(default_factory=list)
    wall_s: float = 0.0
    isolation: str = ""
    stderr_tail: str = ""


def accelerator_present() -> bool:
    """A TPU (/dev/accel*, /dev/vfio) or NVIDIA GPU (/dev/nvidia0) device node exists on this host."""
    dev = Path("/dev")
    return any(dev.glob("accel*")) or (dev / "vfio").exists() or (dev / "nvidia0").exists()


def bubblewrap_path() -> str | None:
    return shutil.which("bwrap")


def _bwrap_usable(bwrap: str) -> bool:
    """bwrap can be installed yet unusable (no user namespaces in a container); try it once."""
    global _bwrap_checked
    if _bwrap_checked is None:
        try:
            r = subprocess.run(
                [bwrap, "--ro-bind", "/", "/", "--unshare-net", "--dev", "/dev", "--proc", "/proc", "true"],
                capture_output=True,
                timeout=20,
            )
            _bwrap_checked = r.returncode == 0
            if not _bwrap_checked:
                log.warning("bubblewrap is installed but cannot run here: %s", r.stderr.decode()[-300:])
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("bubblewrap is installed but cannot run here: %s", exc)
            _bwrap_checked = False
    return _bwrap_checked


_bwrap_checked: bool | None = None


def _under_tmp(p: Path) -> bool:
    try:
        p.resolve().relative_to("/tmp")
        return True
    except ValueError:
        return False


def _bwrap_command(bwrap: str, run_dir: Path, ro_paths: list[Path], allow_device: bool) -> list[str]:
    cmd = [
        bwrap,
        "--ro-bind",
        "/",
        "/",
        "--unshare-net",
        "--unshare-pid",
        "--die-with-parent",
        "--new-session",
    ]
    cmd += ["--dev-bind", "/dev", "/dev"] if allow_device else ["--dev", "/dev"]
    cmd += ["--proc", "/proc", "--tmpfs", "/tmp"]
    # /tmp is private in the child; anything the child must read that lives under /tmp (a venv, a clone
    # of this repo, a task) is bound back read-only, and the run dir read-write.
    seen: set[str] = set()
    for p in ro_paths:
        rp = p.resolve()
        if _under_tmp(rp) and rp.exists() and str(rp) not in seen:
            seen.add(str(rp))
            cmd += ["--ro-bind", str(rp), str(rp)]
    cmd += ["--bind", str(run_dir), str(run_dir), "--chdir", str(run_dir)]
    return cmd


def _package_root() -> Path:
    return Path(__file__).resolve().parents[2]


def _with_limits(cmd: list[str], memory_mb: int) -> list[str]:
    """Apply rlimits through the shell rather than a preexec_fn: forking a process that has JAX's threads
    running is unsafe, while plain spawn (what subprocess uses without preexec_fn) is fine."""
    return [
        "/bin/sh",
        "-c",
        f'ulimit -v {memory_mb * 1024} && ulimit -c 0 && exec "$@"',
        "maxkernel-sandbox",
        *cmd,
    ]


def fresh_run_dir(parent: Path, stem: str) -> Path:
    """A run directory of its own for one child: concurrent children (search branches, bench jobs) never
    share job, progress or result files, even when they evaluate the same thing."""
    import uuid

    path = Path(parent).resolve() / f"{stem}-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True, exist_ok=False)
    return path


def read_progress(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / PROGRESS_FILE
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a crash mid-write
    return events


def run_sandboxed(
    entry: str,
    payload: dict[str, Any],
    run_dir: Path,
    limits: SandboxLimits | None = None,
    read_paths: list[Path] | None = None,
) -> SandboxOutcome:
    """Run `entry` ("maxkernel.module:function") on `payload` in a sandboxed child.

    `read_paths` are files or folders the child must be able to read (task and candidate files); they
    matter only when they live under /tmp, which is private inside bubblewrap.
    """
    global _warned_no_bwrap
    limits = limits or SandboxLimits()
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in (PROGRESS_FILE, RESULT_FILE):
        (run_dir / name).unlink(missing_ok=True)
    (run_dir / "tmp").mkdir(exist_ok=True)
    (run_dir / JOB_FILE).write_text(json.dumps({"entry": entry, "payload": payload}))

    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(run_dir),
        # The child's temp dir is inside the run dir, the only place it may write (see worker's audit hook).
        "TMPDIR": str(run_dir / "tmp"),
        "PYTHONPATH": str(_package_root()),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "XLA_FLAGS": os.environ.get("MAXKERNEL_CHILD_XLA_FLAGS", ""),
    }
    if not limits.allow_device:
        env["JAX_PLATFORMS"] = "cpu"
        # libtpu takes a machine-wide lock file on start-up; with no TPU here, compile-only clients in
        # several children at once must be allowed (on a TPU host the lock is real and stays).
        env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    for key in ("LANG", "LC_ALL", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        if key in os.environ:
            env[key] = os.environ[key]

    python_cmd = [sys.executable, "-m", "maxkernel.tools.worker", str(run_dir)]
    bwrap = bubblewrap_path()
    if bwrap and _bwrap_usable(bwrap):
        ro = [Path(sys.prefix), Path(sys.base_prefix), _package_root(), *(read_paths or [])]
        cmd = _bwrap_command(bwrap, run_dir, ro, limits.allow_device) + python_cmd
        isolation = "bubblewrap"
    else:
        if not _warned_no_bwrap:
            log.warning(
                "bubblewrap (bwrap) is not available: candidates run as plain subprocesses with rlimits, a "
                "timeout and an audit hook, but without file-system or network isolation. "
                "Install it with `apt-get install bubblewrap`."
            )
            _warned_no_bwrap = True
        cmd = python_cmd
        isolation = "rlimits"

    key = secrets.token_bytes(32)
    key_r, key_w = os.pipe()
    os.write(key_w, key)
    os.close(key_w)
    env["MAXKERNEL_KEY_FD"] = str(key_r)

    t0 = time.monotonic()
    stderr_path = run_dir / "stderr.log"
    with open(stderr_path, "wb") as err, open(run_dir / "stdout.log", "wb") as out:
        proc = subprocess.Popen(
            _with_limits(cmd, limits.memory_mb),
            cwd=run_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
            pass_fds=(key_r,),
        )
        timed_out = False
        try:
            proc.wait(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
        except BaseException:
            _kill_group(proc)  # Ctrl-C in the agent must not leave a child behind
            raise
        finally:
            os.close(key_r)
    wall = time.monotonic() - t0
    stderr_tail = stderr_path.read_text(errors="replace")[-4000:]
    events = read_progress(run_dir)
    stage = next((e["stage"] for e in reversed(events) if "stage" in e), None)
    violations = [e["violation"] for e in events if "violation" in e]
    base: dict[str, Any] = dict(
        returncode=proc.returncode,
        stage=stage,
        wall_s=wall,
        isolation=isolation,
        stderr_tail=stderr_tail,
        violations=violations,
        timed_out=timed_out,
    )
    if timed_out:
        return SandboxOutcome(ok=False, error=f"timed out after {limits.timeout_s:g} s", **base)
    result_path = run_dir / RESULT_FILE
    if not result_path.exists():
        return SandboxOutcome(ok=False, error=_death_message(proc.returncode, stderr_tail), **base)
    try:
        envelope = json.loads(result_path.read_text())
        body = envelope["body"]
        forged = not hmac.compare_digest(envelope["mac"], sign(key, body))
        result = json.loads(body)
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        return SandboxOutcome(ok=False, error=f"the child wrote an unreadable result: {exc}", **base)
    if forged:
        base["violations"] = [*violations, "forged the result file"]
        return SandboxOutcome(
            ok=False, error="result file not written by the harness (forged): rejected", **base
        )
    if result.get("ok"):
        return SandboxOutcome(ok=True, value=result.get("value"), **base)
    return SandboxOutcome(ok=False, error=result.get("error", "unknown error"), **base)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _death_message(returncode: int | None, stderr_tail: str) -> str:
    # A signal shows as a negative code from a direct child, and as 128+N through bubblewrap's init.
    signum = -returncode if (returncode is not None and returncode < 0) else None
    if returncode is not None and 128 < returncode < 128 + 65:
        signum = returncode - 128
    if signum is not None:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        msg = f"process killed by {name}"
        if name == "SIGKILL":
            msg += " (memory limit or external kill)"
    else:
        msg = f"process exited with status {returncode} without reporting a result"
    tail = [ln for ln in stderr_tail.strip().splitlines() if ln.strip()][-3:]
    if tail:
        msg += ": " + " | ".join(tail)
    return msg
