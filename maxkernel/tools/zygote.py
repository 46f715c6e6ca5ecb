"""A pre-imported process that forks one fresh, sandboxed child per job: evaluations without the import bill.

Each sandboxed child used to pay a fresh interpreter, bubblewrap and the JAX/Pallas imports (seconds on a
loaded 2-core machine) before doing anything. The zygote pays that once:

```
agent ──(unix seqpacket: JSON + passed fds)──► zygote (bubblewrap, root-in-sandbox, JAX imported, NO backend)
                                                  │ fork (per job)
                                                  └─ middle: setsid, own mount/pid/net/ipc/uts namespaces,
                                                     │ every other run dir hidden under a tmpfs, fresh /tmp,
                                                     │ wall-clock limit; waits and reports the exit status
                                                     └─ job (pid 1 of its pid namespace): fresh /proc, rlimits,
                                                        drops to nobody, no caps, no new privileges,
                                                        then `worker.run_job` exactly as a spawned child would
```

What makes it safe to reuse:

* the zygote never runs task or candidate code, and never reads a job's key or secret: those travel as file
  descriptors (SCM_RIGHTS) that only the job reads. What a job changes (module globals, monkeypatched JAX,
  files in /tmp) dies with its forked copy; the next job forks from the untouched zygote again;
* the zygote is non-dumpable (no ptrace, no /proc/PID/mem) and, under a root agent, root while the jobs are
  `nobody`, so a job cannot reach into it or signal it;
* JAX is imported but no backend is initialised in the zygote (`jax._src.xla_bridge._backends` stays empty):
  after `import jax, jax.experimental.pallas.tpu` the process has no XLA threads, so `fork` is safe; each
  job initialises its own CPU client and libtpu topology after the fork;
* a zygote is keyed by the toolchain (jax, jaxlib, libtpu versions and a hash of maxkernel's sources), the
  folder its run dirs live under, the read-only task paths and the device setting: a change of any of them
  starts a new one (`ZygotePool`), and the stale one is closed.

If the zygote cannot start (no bubblewrap, no namespaces, an import failing), `sandbox.SandboxedChild` falls
back to spawning a fresh child per job and says so once in the log.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import importlib
import itertools
import json
import logging
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from maxkernel.tools.reaper import set_limit

log = logging.getLogger(__name__)

PRELOAD = (
    "numpy",
    "ml_dtypes",
    "jax",
    "jax.numpy",
    "jax.export",
    "jax.experimental.pallas",
    "jax.experimental.pallas.tpu",
    "jax.experimental.topologies",
    "maxkernel.tools.worker",
    "maxkernel.tools.candidate",
    "maxkernel.tools.judge",
    "maxkernel.tools.evaluation",
    "maxkernel.tools.program_tree",
    "maxkernel.tools.taskcode",
    "maxkernel.tools.estimate",
    "maxkernel.tools.stablehlo_check",
    "maxkernel.tools.tpu_specs",
)
"""What every zygote imports before it forks: all that the judge and the candidate jobs import."""
TOOLCHAIN_PACKAGES = ("jax", "jaxlib", "libtpu", "numpy", "ml_dtypes")
START_TIMEOUT_S = 180.0
MAX_MESSAGE = 1 << 16
MAX_ZYGOTES = 4
"""Zygotes kept at once (one for candidates and one per task's judge, per work folder): each holds JAX."""
JOB_FDS = 4
"""A job's descriptors after the fork: 0 stdin, 1 stdout, 2 stderr, 3 the one-time key pipe."""
KEY_FD = 3
EXIT_TIMEOUT = 124
EXIT_KILLED = 128 + signal.SIGKILL
"""A job killed on request: the status a SIGKILLed process reports through a shell."""

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
CAP_LAST = 63
NOBODY = 65534


class ZygoteError(RuntimeError):
    """The zygote could not start or died: the caller falls back to spawning."""


# --- the toolchain ---------------------------------------------------------------------------------------


def toolchain_fingerprint() -> str:
    """Versions of the packages a job imports and a hash of maxkernel's own sources: what a zygote froze
    into memory. Any change means the zygote would run stale code, so it is part of its key."""
    h = hashlib.sha256()
    for name in TOOLCHAIN_PACKAGES:
        try:
            h.update(f"{name}={metadata.version(name)};".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{name}=none;".encode())
    pkg = Path(__file__).resolve().parents[1]
    for path in sorted(pkg.rglob("*.py")):
        h.update(str(path.relative_to(pkg)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:24]


# --- inside the zygote -----------------------------------------------------------------------------------


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(
    libc: ctypes.CDLL, src: str | None, target: str, fstype: str | None, flags: int, data: str = ""
) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data) if data else None),
           f"mount {target}")  # fmt: skip


def _prctl(libc: ctypes.CDLL, option: int, value: int) -> int:
    return int(libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0))


def _drop_privileges(libc: ctypes.CDLL) -> str:
    """No capability can come back: bounding set emptied, no new privileges, then `nobody` (a real uid when
    the zygote is the host's root) or, inside a user namespace where only one uid is mapped, an empty
    capability set. Returns how it dropped."""
    for cap in range(CAP_LAST + 1):
        _prctl(libc, PR_CAPBSET_DROP, cap)  # EINVAL past the kernel's last cap: fine
    _check(_prctl(libc, PR_SET_NO_NEW_PRIVS, 1), "no_new_privs")
    try:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        return "nobody"
    except OSError:
        pass

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]  # fmt: skip

    hdr = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (Data * 2)()
    _check(libc.capset(ctypes.byref(hdr), data), "capset")
    return "no capabilities"


def _loopback_up() -> None:
    """A new network namespace starts with `lo` down; bubblewrap brings it up, so do we (libraries that
    probe a local address then fail at once instead of waiting)."""
    import fcntl
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), siocgifflags, ifreq))[1]
        fcntl.ioctl(s.fileno(), siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def _outermost(paths: list[str]) -> list[str]:
    """`paths` without those that lie inside another of them (binding the outer one brings them along)."""
    out: list[str] = []
    for p in sorted(set(paths)):
        if not any(p == o or p.startswith(o.rstrip("/") + "/") for o in out):
            out.append(p)
    return out


def _rebind_read_only(libc: ctypes.CDLL, held: list[tuple[str, int]]) -> None:
    """Bind the held read-only paths back where they were (the fresh /tmp hid them), read-only again."""
    for path, fd in held:
        target = Path(path)
        for anc in reversed(target.parents):  # mount points nobody can traverse
            if str(anc).startswith("/tmp/") and not anc.exists():
                anc.mkdir(mode=0o755)
                os.chmod(anc, 0o755)
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            target.mkdir(mode=0o755, exist_ok=True)
        else:
            target.touch(exist_ok=True)
        _mount(libc, f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
        try:
            _mount(libc, None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        except OSError:
            pass  # a user namespace may keep the flags locked as they were: the source bind is read-only


def _isolate(libc: ctypes.CDLL, root: str, run_dir: str, read_paths: list[str]) -> None:
    """New namespaces for this job; a fresh /tmp; of the zygote's writable folder only the job's own run
    dir stays (a tmpfs hides the rest, read-only unless it is the fresh /tmp itself). Read-only paths that
    lived under /tmp (the task, the environment, maxkernel itself when a checkout is under /tmp) are bound
    back into the fresh /tmp, still read-only: hiding them would leave the job unable to import."""
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    _loopback_up()
    keep = os.open(run_dir, os.O_PATH | os.O_DIRECTORY)
    under = [p for p in _outermost(read_paths) if p.startswith("/tmp/") and os.path.exists(p)]
    held = [(p, os.open(p, os.O_PATH)) for p in under]
    _mount(libc, "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777")
    under_tmp = root == "/tmp" or root.startswith("/tmp/")
    if not under_tmp:  # else the fresh /tmp already hides it
        _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    os.makedirs(run_dir, exist_ok=True)
    for anc in Path(run_dir).parents:  # makedirs' modes are filtered by the umask; nobody must traverse
        if str(anc).startswith("/tmp/" if under_tmp else root):
            os.chmod(anc, 0o755)
    _mount(libc, f"/proc/self/fd/{keep}", run_dir, None, MS_BIND)
    os.close(keep)
    _rebind_read_only(libc, held)
    if not under_tmp:
        _mount(
            libc, "tmpfs", root, "tmpfs", MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=1m,mode=0755"
        )


def _job(libc: ctypes.CDLL, req: dict[str, Any]) -> None:
    """pid 1 of the job's own pid namespace: becomes the sandboxed worker and never returns."""
    code = 1
    try:
        try:
            _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except OSError:
            pass  # a user namespace may refuse a fresh /proc; the pid namespace still hides other jobs
        memory, fsize = int(req["memory_mb"]) << 20, int(req["file_mb"]) << 20
        set_limit(resource.RLIMIT_CORE, 0)
        set_limit(resource.RLIMIT_AS, memory)
        set_limit(resource.RLIMIT_FSIZE, fsize)
        set_limit(resource.RLIMIT_NOFILE, 4096)
        _drop_privileges(libc)
        # After the drop: changing credentials clears the parent-death signal, and a job whose middle
        # process was killed then ran on, orphaned, writing into a run dir the agent was deleting.
        _prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)
        # The zygote's non-dumpable flag survives the fork; left on, the job could not read its own
        # /proc/self (owned by root then), which libraries use to size thread pools. Other jobs cannot
        # see this one (their own pid namespaces), and the zygote stays non-dumpable.
        _prctl(libc, PR_SET_DUMPABLE, 1)
        os.chdir(req["run_dir"])
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in req["env"].items()})
        os.environ["MAXKERNEL_KEY_FD"] = str(KEY_FD)
        tempfile.tempdir = None  # TMPDIR is the job's now
        from maxkernel.tools.worker import main

        code = main(req["run_dir"])
    except BaseException:  # noqa: BLE001 - the job's process ends here whatever happened
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _middle(libc: ctypes.CDLL, req: dict[str, Any], fds: list[int], ctrl: socket.socket, root: str,
            read_paths: list[str]) -> None:  # fmt: skip
    """The forked child: isolates, forks the job into its new pid namespace, enforces the wall-clock limit
    and exits with the job's status (128+N for a signal, 124 on timeout), as the spawning reaper does."""
    code = 1
    try:
        ctrl.close()
        os.setsid()
        _prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)
        for target, fd in enumerate(fds[:JOB_FDS]):
            os.dup2(fd, target)
        os.closerange(JOB_FDS, 1 << 16)
        job_pid: list[int] = []

        def end_job(code: int) -> None:
            # Kill the job and reap it before this process exits: the job is pid 1 of its namespace, so
            # its exit waits for every process in it. Exiting first (leaving the job to its death signal)
            # let the agent delete a run dir the job's processes were still writing into.
            if job_pid:
                os.kill(job_pid[0], signal.SIGKILL)
                os.waitpid(job_pid[0], 0)
            os._exit(code)

        signal.signal(signal.SIGTERM, lambda _s, _f: end_job(EXIT_KILLED))
        _isolate(libc, root, req["run_dir"], read_paths)
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _job(libc, req)
        job_pid.append(pid)
        os.close(KEY_FD)
        os.close(0)
        signal.signal(signal.SIGALRM, lambda _s, _f: end_job(EXIT_TIMEOUT))
        signal.setitimer(signal.ITIMER_REAL, float(req["timeout_s"]))
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        code = 128 - rc if rc < 0 else rc
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def serve(root: str, ctrl_fd: int, preload: list[str], read_paths: list[str] | None = None) -> int:
    """The zygote's loop: fork on request, kill on request, report every exit. Ends when the agent's end
    of the control socket closes (the agent exited), taking its jobs with it."""
    read_paths = list(read_paths or [])
    for name in preload:
        importlib.import_module(name)
    from maxkernel.tools.worker import settle_optional_imports

    settle_optional_imports()  # once here, not once per interpret-mode lowering in every job
    libc = _libc()
    _prctl(libc, PR_SET_DUMPABLE, 0)
    ctrl = socket.socket(fileno=ctrl_fd)
    from jax._src import xla_bridge

    ctrl.send(json.dumps({"ready": True, "pid": os.getpid(), "backends": len(xla_bridge._backends)}).encode())
    jobs: dict[int, str] = {}
    try:
        while True:
            ready, _, _ = select.select([ctrl], [], [], 0.02)
            if ready:
                msg, fds, _flags, _addr = socket.recv_fds(ctrl, MAX_MESSAGE, JOB_FDS)
                if not msg:
                    break
                req = json.loads(msg)
                if req.get("op") == "fork":
                    pid = os.fork()
                    if pid == 0:
                        _middle(libc, req, fds, ctrl, root, read_paths)
                    for fd in fds:
                        os.close(fd)
                    jobs[pid] = req["id"]
                    ctrl.send(json.dumps({"id": req["id"], "pid": pid}).encode())
                elif req.get("op") == "kill":
                    pid = next((p for p, i in jobs.items() if i == req["id"]), None)
                    if pid is not None:  # the job's middle process kills and reaps it, then exits
                        os.kill(pid, signal.SIGTERM)
            while jobs:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                job_id = jobs.pop(pid, None)
                if job_id is not None:
                    rc = os.waitstatus_to_exitcode(status)
                    ctrl.send(json.dumps({"id": job_id, "exit": rc}).encode())
    except (BrokenPipeError, ConnectionResetError):
        pass
    for pid in jobs:  # each middle kills and reaps its job
        os.kill(pid, signal.SIGTERM)
    return 0


def probe_job(payload: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """A self-check of a forked job's isolation (tests, diagnostics): what it can see and be, and, when asked,
    the state a hostile candidate would try to leave behind for the next job — a module global, a
    monkeypatched JAX function, a file in /tmp, a file next to its run dir."""
    import jax.numpy as jnp

    from maxkernel.tools import candidate
    from maxkernel.tools.worker import OPTIONAL_IMPORTS

    facts: dict[str, Any] = {
        "uid": os.getuid(),
        "pid": os.getpid(),
        "tmp": sorted(os.listdir("/tmp")),
        "global_left": getattr(candidate, "_LEFT_BEHIND", None),
        "jnp_add_patched": getattr(jnp.add, "_left_behind", False),
        "siblings": sorted(os.listdir(Path(ctx.run_dir).parent)),
        "backends_before": len(__import__("jax._src.xla_bridge", fromlist=["_backends"])._backends),
        # Tried once in the zygote (imported, or recorded as missing): no job re-runs a failing import.
        "optional_imports_settled": all(n in sys.modules for n in OPTIONAL_IMPORTS),
    }
    if payload.get("read"):  # a read-only path the job was given: readable, and not writable
        target = Path(str(payload["read"]))
        facts["read"] = target.read_text() if target.exists() else None
        try:
            target.write_text("overwritten")
            facts["read_writable"] = True
        except OSError:
            facts["read_writable"] = False
    if payload.get("scribble"):  # a job that writes into its run dir until it is killed, from two processes
        tag = "child" if os.fork() == 0 else "parent"
        for n in itertools.count():
            (Path(ctx.run_dir) / f"{tag}-{n % 1000}").write_text("x")
    if payload.get("leave_state"):
        candidate._LEFT_BEHIND = "yes"  # type: ignore[attr-defined]

        def patched(*a: Any, **k: Any) -> Any:
            return None

        patched._left_behind = True  # type: ignore[attr-defined]
        jnp.add = patched
        Path("/tmp/left_behind").write_text("x")
        try:
            (Path(ctx.run_dir).parent / "left_behind").write_text("x")
            facts["wrote_beside_run_dir"] = True
        except OSError:
            facts["wrote_beside_run_dir"] = False
    facts["sum"] = float(jnp.ones(3).sum()) if not payload.get("leave_state") else None
    return facts


# --- the agent's side ------------------------------------------------------------------------------------


class ZygoteProc:
    """A job forked by a zygote, shaped like the `subprocess.Popen` that `SandboxedChild` otherwise holds."""

    def __init__(self, zygote: Zygote, job_id: str, stdin: Any) -> None:
        self.zygote, self.id, self.stdin = zygote, job_id, stdin
        self.pid: int | None = None
        self.returncode: int | None = None
        self.lost = False
        """The zygote died under it: an infrastructure failure, never the job's verdict."""
        self._done = threading.Event()

    def _exited(self, code: int | None, lost: bool = False) -> None:
        if not self._done.is_set():
            self.returncode, self.lost = code, lost
            self._done.set()

    def poll(self) -> int | None:
        return self.returncode if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> int | None:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired("zygote job", timeout or 0.0)
        return self.returncode

    def kill(self) -> None:
        if not self._done.is_set():
            self.zygote.send({"op": "kill", "id": self.id})


class Zygote:
    """One zygote process and the thread that reads its reports."""

    def __init__(self, command: list[str], env: dict[str, str], root: Path, preload: tuple[str, ...],
                 read_paths: list[str] | None = None) -> None:  # fmt: skip
        self.root = root
        self._jobs: dict[str, ZygoteProc] = {}
        self._lock = threading.Lock()
        self._seq = 0
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self.started_s = 0.0
        t0 = time.monotonic()
        cmd = [*command, sys.executable, "-m", "maxkernel.tools.zygote", str(root), str(theirs.fileno()),
               ",".join(preload), json.dumps(sorted(read_paths or []))]  # fmt: skip
        # The zygote's own log lives outside its root (the root is the callers' run dirs, cleaned by them)
        # in a file with no name: nothing is left behind in /tmp when the agent is killed without a close().
        self._log = tempfile.TemporaryFile(prefix="maxkernel-zygote-")
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
            pass_fds=(theirs.fileno(),), start_new_session=True,
        )  # fmt: skip
        theirs.close()
        ready, _, _ = select.select([ours], [], [], START_TIMEOUT_S)
        msg = ours.recv(MAX_MESSAGE) if ready else b""
        if not msg:
            tail = self.log_tail()
            self.close()
            raise ZygoteError(f"the zygote did not start: {tail or 'no output'}")
        hello = json.loads(msg)
        if hello.get("backends"):
            self.close()
            raise ZygoteError("the zygote initialised a JAX backend before forking: refusing to fork it")
        self.pid = int(hello["pid"])
        self.started_s = time.monotonic() - t0
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    def alive(self) -> bool:
        return self.proc.poll() is None and self._reader.is_alive()

    def send(self, msg: dict[str, Any], fds: list[int] | None = None) -> None:
        data = json.dumps(msg).encode()
        with self._lock:
            if fds:
                socket.send_fds(self._sock, [data], fds)
            else:
                self._sock.send(data)

    def spawn(self, run_dir: Path, env: dict[str, str], limits: dict[str, Any], *, stdin: bool,
              stdout_fd: int, stderr_fd: int, key_fd: int) -> ZygoteProc:  # fmt: skip
        """Fork a job in `run_dir` (under this zygote's root). Raises ZygoteError if the zygote is gone."""
        if stdin:
            stdin_r, stdin_w = os.pipe()
            writer = os.fdopen(stdin_w, "wb")
        else:
            stdin_r, writer = os.open(os.devnull, os.O_RDONLY), None
        with self._lock:
            self._seq += 1
            job_id = f"j{self._seq}"
        proc = ZygoteProc(self, job_id, writer)
        self._jobs[job_id] = proc
        req = {"op": "fork", "id": job_id, "run_dir": str(run_dir), "env": env, **limits}
        try:
            self.send(req, [stdin_r, stdout_fd, stderr_fd, key_fd])
        except OSError as exc:
            self._jobs.pop(job_id, None)
            if writer is not None:
                writer.close()
            raise ZygoteError(f"the zygote is gone: {exc}") from exc
        finally:
            os.close(stdin_r)
        return proc

    def _read(self) -> None:
        while True:
            try:
                msg = self._sock.recv(MAX_MESSAGE)
            except OSError:
                msg = b""
            if not msg:
                break
            event = json.loads(msg)
            proc = self._jobs.get(str(event.get("id")))
            if proc is None:
                continue
            if "pid" in event:
                proc.pid = int(event["pid"])
            if "exit" in event:
                self._jobs.pop(proc.id, None)
                proc._exited(int(event["exit"]))
        for proc in list(self._jobs.values()):
            proc._exited(None, lost=True)
        self._jobs.clear()

    def close(self) -> None:
        # shutdown first: the reader thread is blocked in recv on this socket, and a plain close() from
        # another thread leaves the socket open until that recv returns, which it never does. The zygote
        # would not see the end of its control socket, and it and its bubblewrap stayed behind forever.
        for end in (lambda: self._sock.shutdown(socket.SHUT_RDWR), self._sock.close):
            try:
                end()
            except OSError:
                pass
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def log_tail(self, limit: int = 800) -> str:
        """The end of the zygote's own stderr (start-up errors), while it is open."""
        if self._log.closed:
            return ""
        self._log.seek(0, os.SEEK_END)
        self._log.seek(max(0, self._log.tell() - limit))
        return self._log.read().decode(errors="replace").strip()


class ZygotePool:
    """The agent's zygotes, by key; a key that no longer matches the toolchain is never served again."""

    def __init__(self) -> None:
        self._zygotes: dict[tuple[Any, ...], Zygote] = {}
        self._failed: dict[tuple[Any, ...], str] = {}
        self._lock = threading.Lock()
        self.started = 0
        """Zygotes started by this pool (tests read it: a toolchain change must start a new one)."""

    def get(self, key: tuple[Any, ...], make: Any) -> Zygote:
        """The live zygote for `key`, started with `make()` if needed; ZygoteError if it cannot start
        (remembered, so a broken setup costs one attempt per key, not one per job)."""
        with self._lock:
            if key in self._failed:
                raise ZygoteError(self._failed[key])
            z = self._zygotes.get(key)
            if z is not None and z.alive():
                self._zygotes[key] = self._zygotes.pop(key)  # most recently used last
                return z
            if z is not None:
                z.close()
                del self._zygotes[key]
            toolchain = key[0]
            for stale in [k for k in self._zygotes if k[0] != toolchain]:
                log.info("toolchain changed: closing a zygote started for the old one")
                self._zygotes.pop(stale).close()
            while len(self._zygotes) >= MAX_ZYGOTES:
                self._zygotes.pop(next(iter(self._zygotes))).close()
            try:
                z = make()
            except (ZygoteError, OSError) as exc:
                self._failed[key] = str(exc)
                raise ZygoteError(str(exc)) from exc
            self.started += 1
            self._zygotes[key] = z
            return z

    def pids(self) -> list[int]:
        """Host process ids of the live zygotes (their bubblewrap parents), least recently used first."""
        with self._lock:
            return [z.proc.pid for z in self._zygotes.values() if z.alive()]

    def close(self) -> None:
        with self._lock:
            for z in self._zygotes.values():
                z.close()
            self._zygotes.clear()
            self._failed.clear()


POOL = ZygotePool()
atexit.register(POOL.close)


def main(argv: list[str]) -> int:
    root, fd, preload = argv[0], int(argv[1]), [p for p in argv[2].split(",") if p]
    read_paths = json.loads(argv[3]) if len(argv) > 3 else []
    return serve(root, fd, preload, read_paths)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
