"""Run untrusted code (candidate kernels, task references) in a child process and get data back.

The child is `python -m maxkernel.tools.worker RUN_DIR` under `maxkernel.tools.reaper` (rlimits, new
session, every descendant killed at the end even if it called `setsid`), and under bubblewrap when it works:

* the file system is built from nothing: the interpreter's prefixes, the `maxkernel` package, system
  libraries (/usr, /lib*), a short list of /etc files (no /etc/shadow), the paths the caller names
  (task files) read-only, and the run dir read-write. /run, /var and the host's /tmp are absent, so no
  host UNIX socket can be reached; the network namespace is private, so no abstract socket or TCP either;
* the child runs as `nobody` (uid 65534): through `setpriv` when the agent is root (a user namespace
  would map 65534 back onto root for file access), through `--unshare-user --uid 65534` otherwise;
* the environment is rebuilt from an allow-list (`--clearenv`): no API keys ever reach the child.

Without bubblewrap (the *fallback*), the same reaper, rlimits and scrubbed environment apply, and a root
agent's child still drops to `nobody`; but the file system and network are the host's. Candidates written
by a model therefore refuse to run in the fallback unless `SandboxLimits.allow_unsandboxed` is set (the
offline author's own kernels may). What the fallback cannot prevent is listed in the README.

Nothing here raises for anything the child does: a hang, a crash, `os._exit`, an exception, a forged or
malformed result, a flood of output or files all come back as a `SandboxOutcome`. What the child leaves
in its run dir is read through `maxkernel.tools.readback` (type, size and count checked) and the run dir
is deleted afterwards unless the caller keeps it.
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

from maxkernel.tools.readback import (
    MAX_JSON_BYTES,
    MAX_RUN_DIR_ENTRIES,
    ReadBackError,
    bounded_json,
    count_entries,
    file_size,
    read_capped,
    tail_text,
)
from maxkernel.tools.worker import sign
from maxkernel.tools.zygote import POOL as ZYGOTES
from maxkernel.tools.zygote import PRELOAD as ZYGOTE_PRELOAD
from maxkernel.tools.zygote import Zygote, ZygoteError, ZygoteProc, toolchain_fingerprint

log = logging.getLogger(__name__)

PROGRESS_FILE = "progress.jsonl"
RESULT_FILE = "result.json"
JOB_FILE = "job.json"
NOBODY = 65534
MAX_PROGRESS_BYTES = 1 << 20

ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "passwd", "group")
"""The only /etc entries a child sees: the dynamic loader's and user names; never shadow, keys or hosts."""
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32")
ENV_PASSED = ("LANG", "LC_ALL", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
"""Host variables a child may inherit. Everything else (API keys above all) is dropped."""

_warned_no_bwrap = False
_zygote_warned: set[str] = set()
_bwrap_checked: bool | None = None


def machine_load_factor() -> float:
    """How much slower than idle this machine runs now: the 1-minute load average per core, in [1, 8].

    A shared machine under load (a bench with parallel jobs, other users) stretches every stage of an
    evaluation alike; without this a reference that takes 20 s idle times out at 90 s under a load of 8
    per core, and a correct task is reported as failed."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return 1.0
    return float(min(8.0, max(1.0, load / max(1, os.cpu_count() or 1))))


class SandboxLimits(BaseModel):
    timeout_s: float = Field(600.0, description="wall-clock limit for the whole child process")
    memory_mb: int = Field(12_000, description="address-space limit (RLIMIT_AS); JAX reserves a lot of it")
    file_mb: int = Field(256, description="largest file the child may write (RLIMIT_FSIZE): logs, outputs")
    max_entries: int = Field(MAX_RUN_DIR_ENTRIES, description="files+dirs the run dir may hold at the end")
    allow_device: bool = Field(
        False, description="pass accelerator device nodes through and let JAX use them (device timing)"
    )
    fallback_as_nobody: bool = Field(
        True,
        description="without bubblewrap, a root agent's child drops to nobody. The judge keeps root there, "
        "so that a candidate (nobody) can neither trace it nor read its run dir",
    )
    allow_unsandboxed: bool = Field(
        True,
        description="run even without bubblewrap (fallback: rlimits, scrubbed env, nobody when root); "
        "False for code a model wrote, which then refuses to run where bubblewrap is missing",
    )


class SandboxOutcome(BaseModel):
    """What happened to the child. `value` is the entry function's return value when it returned."""

    ok: bool
    value: dict[str, Any] | None = None
    stage: str | None = Field(None, description="last stage the child announced before it stopped")
    error: str | None = None
    returncode: int | None = None
    timed_out: bool = False
    infrastructure: bool = Field(
        False, description="the child never got to run the job (sandbox or interpreter broken): not a verdict"
    )
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
                [bwrap, *_system_binds(), "--unshare-net", "--dev", "/dev", "--proc", "/proc", "true"],
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


def isolation_available() -> str:
    """'bubblewrap' or 'fallback': what a child started now would run under."""
    bwrap = bubblewrap_path()
    return "bubblewrap" if bwrap and _bwrap_usable(bwrap) else "fallback"


def _system_binds() -> list[str]:
    args: list[str] = []
    for d in SYSTEM_DIRS:
        p = Path(d)
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), d]
        elif p.is_dir():
            args += ["--ro-bind", d, d]
    for name in ETC_FILES:
        p = Path("/etc") / name
        if p.exists():
            args += ["--ro-bind", str(p), str(p)]
    return args


def _bwrap_command(
    bwrap: str,
    run_dir: Path,
    ro_paths: list[Path],
    env: dict[str, str],
    allow_device: bool,
    *,
    zygote: bool = False,
) -> list[str]:
    """The bubblewrap command line for one child, or (`zygote=True`) for a zygote: the same file system
    with `run_dir` as the folder its jobs' run dirs live under, keeping the capabilities it needs to give
    each forked job namespaces of its own before the job drops them all (`maxkernel.tools.zygote`). A zygote
    is not tied to the starting thread's life (`--die-with-parent` is per thread); it exits when the
    agent's end of its control socket closes."""
    cmd = [bwrap, "--new-session", "--unshare-net", "--unshare-pid", "--unshare-ipc"]
    if not zygote:
        cmd.insert(1, "--die-with-parent")
    cmd += ["--unshare-uts", "--unshare-cgroup-try", *_system_binds()]
    cmd += ["--proc", "/proc", "--size", str(64 << 20), "--tmpfs", "/tmp"]
    cmd += ["--dev-bind", "/dev", "/dev"] if allow_device else ["--dev", "/dev"]
    if allow_device:
        cmd += ["--ro-bind", "/sys", "/sys"]
    made: set[str] = {"/", "/tmp", *SYSTEM_DIRS}

    def parents(path: Path) -> list[str]:
        # bwrap creates missing mount points 0700, which `nobody` cannot traverse: make them 0755 first.
        args: list[str] = []
        for anc in reversed(path.parents):
            a = str(anc)
            if a not in made:
                made.add(a)
                args += ["--perms", "0755", "--dir", a]
        return args

    cpus = Path("/sys/devices/system/cpu")
    if not allow_device and cpus.is_dir():
        cmd += [*parents(cpus), "--ro-bind", str(cpus), str(cpus)]  # tcmalloc (libtpu) counts CPUs there
    seen: set[str] = set()
    for p in ro_paths:
        rp = p.resolve()
        if (
            not rp.exists()
            or str(rp) in seen
            or any(str(rp).startswith(s + "/") for s in seen | set(SYSTEM_DIRS))
        ):
            continue
        seen.add(str(rp))
        cmd += [*parents(rp), "--ro-bind", str(rp), str(rp)]
    cmd += [*parents(run_dir), "--bind", str(run_dir), str(run_dir), "--chdir", str(run_dir)]
    cmd += ["--clearenv"]
    for k, v in env.items():
        cmd += ["--setenv", k, v]
    if zygote:
        if os.geteuid() != 0:
            cmd[1:1] = ["--unshare-user", "--uid", "0", "--gid", "0"]
        cmd += ["--cap-add", "ALL", "--"]
    elif os.geteuid() == 0:
        # As root a user namespace maps the child's 65534 back onto root for file access; drop for real.
        cmd += ["--", shutil.which("setpriv") or "/usr/bin/setpriv", "--reuid", str(NOBODY), "--regid",
                str(NOBODY), "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"]  # fmt: skip
    else:
        cmd[1:1] = ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)]
        cmd += ["--"]
    return cmd


def _package_root() -> Path:
    return Path(__file__).resolve().parents[2]


def _unreadable_by_others(path: Path) -> str | None:
    """The first of `path` and its ancestors that a user other than its owner and group cannot reach
    (a folder without o+x, or the path itself without o+r), as 'PATH (mode)'; None when all can be."""
    path = Path(path)
    chain = [*reversed(path.parents), path]
    for i, p in enumerate(chain):
        try:
            mode = p.stat().st_mode
        except OSError:
            return None  # not there: nothing to read, the caller reports what is missing
        need = 0o001 if i < len(chain) - 1 else (0o005 if p.is_dir() else 0o004)
        if mode & need != need:
            return f"{p} (mode {oct(mode & 0o777)})"
    return None


_fallback_problem: dict[str, str | None] = {}


def fallback_unreadable() -> str | None:
    """Why a child dropped to `nobody` in the fallback cannot run here, or None. The worker imports what a
    job needs as root and only then drops, so the interpreter and the standard library may be private; but
    JAX and jaxlib import modules lazily (the Pallas interpreters, export), after the drop, and maxkernel's
    own modules are read then too: those packages must be readable by other users. A checkout or venv in
    a private folder (a 0700 temp dir, /root/...) is common in containers; the answer says which path and
    what to do."""
    key = sys.prefix
    if key not in _fallback_problem:
        import jax
        import numpy

        paths = [Path(numpy.__file__).resolve(), Path(jax.__file__).resolve(),
                 _package_root() / "maxkernel" / "tools" / "worker.py"]  # fmt: skip
        try:
            import jaxlib

            paths.append(Path(jaxlib.__file__).resolve())
        except ImportError:
            pass
        bad = next((b for b in map(_unreadable_by_others, paths) if b), None)
        _fallback_problem[key] = (
            None
            if bad is None
            else (
                f"without bubblewrap the candidate runs as `nobody`, who cannot read {bad}: install bubblewrap "
                "(apt-get install bubblewrap), or make the interpreter, the virtual environment and this checkout "
                "readable by other users (e.g. chmod o+rX on each folder above them and -R on them), or move "
                "them out of the private folder"
            )
        )
    return _fallback_problem[key]


def fresh_run_dir(parent: Path, stem: str) -> Path:
    """A run directory of its own for one child: concurrent children (search branches, bench jobs) never
    share job, progress or result files, even when they evaluate the same thing."""
    import uuid

    path = Path(parent).resolve() / f"{stem}-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True, exist_ok=False)
    return path


def read_progress(run_dir: Path) -> list[dict[str, Any]]:
    """Stage and violation events, parsed leniently; the file is the child's, so it is size-capped."""
    try:
        text = read_capped(run_dir / PROGRESS_FILE, MAX_PROGRESS_BYTES).decode(errors="replace")
    except ReadBackError:
        return []
    events = []
    for line in text.splitlines():
        try:
            event = bounded_json(line, max_depth=8)
        except ReadBackError:
            continue  # a line cut short by a crash mid-write, or not an event
        if isinstance(event, dict):
            events.append(event)
    return events


def _give_to_nobody(run_dir: Path) -> None:
    """When the agent is root the child runs as nobody and must own its run dir to write there."""
    if os.geteuid() != 0:
        return
    for root, dirs, files in os.walk(run_dir):
        os.chown(root, NOBODY, NOBODY)
        for name in dirs + files:
            os.lchown(os.path.join(root, name), NOBODY, NOBODY)


class SandboxedChild:
    """One child process: started, optionally fed on stdin, waited for; its run dir read defensively.

    `trusted_result=False` (candidate processes) still checks the signature, but callers must treat the
    value as untrusted data either way: the candidate runs in the process that signs.
    """

    def __init__(
        self,
        entry: str,
        payload: dict[str, Any],
        run_dir: Path,
        limits: SandboxLimits | None = None,
        read_paths: list[Path] | None = None,
        *,
        stdin: bool = False,
        preload: tuple[str, ...] = ("numpy", "jax"),
        zygote_root: Path | None = None,
    ) -> None:
        """`zygote_root`: fork this child from a pre-imported zygote whose jobs' run dirs all live under
        this folder (`run_dir` must be below it); None, or a zygote that cannot start: spawn it fresh."""
        self.entry, self.payload = entry, payload
        self.run_dir = Path(run_dir).resolve()
        self.limits = limits or SandboxLimits()
        self.read_paths = list(read_paths or [])
        self.use_stdin = stdin
        self.preload = list(preload)
        self.zygote_root = Path(zygote_root).resolve() if zygote_root is not None else None
        self.proc: subprocess.Popen[bytes] | ZygoteProc | None = None
        self.via_zygote = False
        self.isolation = ""
        self.refused: str | None = None
        self._key = secrets.token_bytes(32)
        self._t0 = 0.0

    # --- start ---------------------------------------------------------------------------------------
    def start(self) -> None:
        global _warned_no_bwrap
        run_dir, limits = self.run_dir, self.limits
        run_dir.mkdir(parents=True, exist_ok=True)
        for name in (PROGRESS_FILE, RESULT_FILE):
            (run_dir / name).unlink(missing_ok=True)
        (run_dir / "tmp").mkdir(exist_ok=True)
        (run_dir / JOB_FILE).write_text(
            json.dumps({"entry": self.entry, "payload": self.payload, "preload": self.preload})
        )
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(run_dir),
            # The child's temp dir is inside the run dir, the only place it may write.
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
            # No metadata server exists in the sandbox's network namespace: do not ask libtpu to retry it.
            env["TPU_SKIP_MDS_QUERY"] = "1"
        for key in ENV_PASSED:
            if key in os.environ:
                env[key] = os.environ[key]

        key_r, key_w = os.pipe()
        os.write(key_w, self._key)
        os.close(key_w)
        env["MAXKERNEL_KEY_FD"] = str(key_r)
        python_cmd = [sys.executable, "-m", "maxkernel.tools.worker", str(run_dir)]
        bwrap = bubblewrap_path()
        if self.zygote_root is not None and bwrap and _bwrap_usable(bwrap):
            if self._start_in_zygote(bwrap, env, key_r):
                return
        as_nobody = os.geteuid() == 0
        if bwrap and _bwrap_usable(bwrap):
            pkg = _package_root() / "maxkernel"
            ro = [Path(sys.prefix), Path(sys.base_prefix), pkg, *self.read_paths]
            inner = _bwrap_command(bwrap, run_dir, ro, env, limits.allow_device) + python_cmd
            self.isolation = "bubblewrap"
        else:
            if not limits.allow_unsandboxed:
                os.close(key_r)
                self.refused = (
                    "bubblewrap is not available and this candidate was written by a model: refusing to run "
                    "it unsandboxed (install bubblewrap, or pass --allow-unsandboxed to accept the risk)"
                )
                return
            if not _warned_no_bwrap:
                log.warning(
                    "bubblewrap (bwrap) is not available: children run under rlimits, a scrubbed environment "
                    "and a reaper, but without file-system or network isolation. "
                    "Install it with `apt-get install bubblewrap`."
                )
                _warned_no_bwrap = True
            inner = python_cmd
            as_nobody = os.geteuid() == 0 and limits.fallback_as_nobody
            if as_nobody:
                problem = fallback_unreadable()
                if problem is not None:
                    os.close(key_r)
                    self.refused = problem
                    self.isolation = "fallback"
                    return
                env["MAXKERNEL_DROP_TO_NOBODY"] = "1"  # the worker drops once its modules are loaded
            self.isolation = "fallback"
        if as_nobody:
            _give_to_nobody(run_dir)
        reaper = [sys.executable, "-m", "maxkernel.tools.reaper", "--timeout", f"{limits.timeout_s:g}"]
        reaper += ["--memory-mb", str(limits.memory_mb), "--fsize-mb", str(limits.file_mb)]
        reaper_env = dict(env, MAXKERNEL_PASS_FDS=str(key_r))
        self._t0 = time.monotonic()
        try:
            with open(run_dir / "stderr.log", "wb") as err, open(run_dir / "stdout.log", "wb") as out:
                self.proc = subprocess.Popen(
                    [*reaper, "--", *inner],
                    cwd=run_dir,
                    env=reaper_env,
                    stdin=subprocess.PIPE if self.use_stdin else subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                    pass_fds=(key_r,),
                )
        except OSError as exc:
            self.refused = f"the sandbox could not start: {exc}"
        finally:
            os.close(key_r)

    def _start_in_zygote(self, bwrap: str, env: dict[str, str], key_r: int) -> bool:
        """Fork this child from the zygote for its setting; False (logged once per reason) if there is
        none, and the caller spawns instead. Closes `key_r` when it returns True."""
        assert self.zygote_root is not None
        root, limits = self.zygote_root, self.limits
        if root not in self.run_dir.parents:
            return False
        base_env = {k: v for k, v in env.items() if k not in ("HOME", "TMPDIR", "MAXKERNEL_KEY_FD")}
        base_env.update(HOME=str(root), TMPDIR="/tmp")
        ro = sorted({str(Path(p).resolve()) for p in self.read_paths})
        key = (toolchain_fingerprint(), str(root), tuple(ro), limits.allow_device,
               tuple(sorted(base_env.items())))  # fmt: skip

        def make() -> Zygote:
            pkg = _package_root() / "maxkernel"
            ro_paths = [Path(sys.prefix), Path(sys.base_prefix), pkg, *map(Path, ro)]
            cmd = _bwrap_command(bwrap, root, ro_paths, base_env, limits.allow_device, zygote=True)
            bound = [str(p.resolve()) for p in ro_paths if p.exists()]
            return Zygote(cmd, {"PATH": "/usr/bin:/bin"}, root, ZYGOTE_PRELOAD, bound)

        try:
            zygote = ZYGOTES.get(key, make)
            if os.geteuid() == 0:
                _give_to_nobody(self.run_dir)
            self._t0 = time.monotonic()
            with (
                open(self.run_dir / "stderr.log", "wb") as err,
                open(self.run_dir / "stdout.log", "wb") as out,
            ):
                self.proc = zygote.spawn(
                    self.run_dir,
                    env,
                    {"timeout_s": limits.timeout_s, "memory_mb": limits.memory_mb, "file_mb": limits.file_mb},
                    stdin=self.use_stdin,
                    stdout_fd=out.fileno(),
                    stderr_fd=err.fileno(),
                    key_fd=key_r,
                )
        except ZygoteError as exc:
            reason = str(exc)[:300]
            if reason not in _zygote_warned:
                _zygote_warned.add(reason)
                log.warning("no zygote (%s): spawning a fresh sandboxed child per job instead", reason)
            return False
        os.close(key_r)
        self.isolation, self.via_zygote = "bubblewrap", True
        return True

    # --- while it runs -------------------------------------------------------------------------------
    def events(self) -> list[dict[str, Any]]:
        return read_progress(self.run_dir)

    def reached(self, stage: str) -> bool:
        return any(e.get("stage") == stage for e in self.events())

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send(self, data: bytes, *, close: bool = True) -> bool:
        """Write to the child's stdin (and close it); False if the child is gone or stopped reading."""
        if self.proc is None or self.proc.stdin is None:
            return False
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
            if close:
                self.proc.stdin.close()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def kill(self) -> None:
        """Ask the reaper to kill everything it started; force it if it does not go."""
        if self.proc is None or self.proc.poll() is not None:
            return
        if isinstance(self.proc, ZygoteProc):
            self.proc.kill()  # the zygote kills the job's whole pid namespace
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    # --- the end -------------------------------------------------------------------------------------
    def wait(self, deadline: float | None = None) -> SandboxOutcome:
        """Wait for the child (at most until `deadline`, monotonic) and read what it left."""
        if self.refused is not None:
            return SandboxOutcome(
                ok=False, error=self.refused, infrastructure=True, isolation=self.isolation or "none"
            )
        assert self.proc is not None
        if deadline is None:
            deadline = self._t0 + self.limits.timeout_s + 10
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
        except BaseException:
            self.kill()  # Ctrl-C in the agent must not leave a child behind
            raise
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        return self._outcome(time.monotonic() - self._t0)

    def _outcome(self, wall: float) -> SandboxOutcome:
        assert self.proc is not None
        code = self.proc.returncode
        run_dir = self.run_dir
        stderr_tail = tail_text(run_dir / "stderr.log")
        events = self.events()
        stage = next((e["stage"] for e in reversed(events) if isinstance(e.get("stage"), str)), None)
        violations = [str(e["violation"])[:500] for e in events if "violation" in e]
        timed_out = code in (124, -signal.SIGTERM, 128 + signal.SIGTERM) or code is None
        base: dict[str, Any] = dict(
            returncode=code,
            stage=stage,
            wall_s=wall,
            isolation=self.isolation,
            stderr_tail=stderr_tail,
            violations=violations,
            timed_out=timed_out,
        )
        entries = count_entries(run_dir, self.limits.max_entries)
        if entries > self.limits.max_entries:
            base["violations"] = [*violations, f"left more than {self.limits.max_entries} files"]
            return SandboxOutcome(ok=False, error="the run dir held too many files: rejected", **base)
        for log_name in ("stdout.log", "stderr.log"):
            if file_size(run_dir / log_name) >= (self.limits.file_mb << 20):
                base["violations"] = [*violations, f"filled {log_name} to the {self.limits.file_mb} MiB cap"]
        if isinstance(self.proc, ZygoteProc) and self.proc.lost:
            return SandboxOutcome(
                ok=False, infrastructure=True, error="the zygote died under the job", **base
            )
        if stage is None and not timed_out:
            # Not even the worker's first announcement: the interpreter or the sandbox is broken.
            return SandboxOutcome(
                ok=False, infrastructure=True, error=_death_message(code, stderr_tail, "the sandbox"), **base
            )
        if timed_out:
            return SandboxOutcome(ok=False, error=f"timed out after {self.limits.timeout_s:g} s", **base)
        try:
            raw = read_capped(run_dir / RESULT_FILE, MAX_JSON_BYTES)
        except ReadBackError as exc:
            if (run_dir / RESULT_FILE).exists() or (run_dir / RESULT_FILE).is_symlink():
                return SandboxOutcome(ok=False, error=f"the child left an unreadable result: {exc}", **base)
            return SandboxOutcome(ok=False, error=_death_message(code, stderr_tail, "process"), **base)
        try:
            envelope = bounded_json(raw)
            body = envelope["body"]
            if not isinstance(body, str):
                raise TypeError("the result's body is not text")
            forged = not hmac.compare_digest(str(envelope["mac"]), sign(self._key, body))
            result = bounded_json(body)
            if not isinstance(result, dict):
                raise TypeError("the result is not an object")
        except (ReadBackError, KeyError, TypeError, UnicodeDecodeError) as exc:
            return SandboxOutcome(ok=False, error=f"the child wrote an unreadable result: {exc}", **base)
        if forged:
            base["violations"] = [*base["violations"], "forged the result file"]
            return SandboxOutcome(
                ok=False, error="result file not written by the harness (forged): rejected", **base
            )
        if result.get("infrastructure"):
            return SandboxOutcome(ok=False, infrastructure=True, error=str(result.get("error")), **base)
        if result.get("ok") and isinstance(result.get("value"), dict):
            return SandboxOutcome(ok=True, value=result["value"], **base)
        return SandboxOutcome(ok=False, error=str(result.get("error", "unknown error"))[:4000], **base)


def run_sandboxed(
    entry: str,
    payload: dict[str, Any],
    run_dir: Path,
    limits: SandboxLimits | None = None,
    read_paths: list[Path] | None = None,
) -> SandboxOutcome:
    """Run `entry` ("maxkernel.module:function") on `payload` in a sandboxed child and wait for it.

    `read_paths` are files or folders the child must be able to read (task files), bound read-only.
    """
    child = SandboxedChild(entry, payload, run_dir, limits, read_paths)
    child.start()
    return child.wait()


def _death_message(returncode: int | None, stderr_tail: str, what: str) -> str:
    # A signal shows as a negative code from a direct child, and as 128+N through the reaper/bubblewrap.
    signum = -returncode if (returncode is not None and returncode < 0) else None
    if returncode is not None and 128 < returncode < 128 + 65:
        signum = returncode - 128
    if signum is not None:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        msg = f"{what} killed by {name}"
        if name == "SIGKILL":
            msg += " (memory limit or external kill)"
        if name == "SIGXFSZ":
            msg += " (wrote a file past the size cap)"
    else:
        msg = f"{what} exited with status {returncode} without reporting a result"
    tail = [ln for ln in stderr_tail.strip().splitlines() if ln.strip()][-3:]
    if tail:
        msg += ": " + " | ".join(tail)
    return msg


def task_read_paths(reference_path: str | Path) -> list[Path]:
    """What a sandboxed child reads of a task: the reference's folder (sibling modules, the yaml), unless
    that folder is private (no world read/search bit): bound whole, a private folder would also hide any run
    dir below it (a work dir inside the task's folder) from the child, which runs as `nobody`; then only
    the reference file itself is bound."""
    ref = Path(reference_path)
    try:
        public = (ref.parent.stat().st_mode & 0o005) == 0o005
    except OSError:
        public = False
    return [ref.parent] if public else [ref]
