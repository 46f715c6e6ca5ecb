"""The child-process side of the sandbox: `python -m maxkernel.tools.worker RUN_DIR`.

Reads RUN_DIR/job.json (`{"entry": "maxkernel.x:y", "payload": {...}}`), calls the entry function with the
payload and a `WorkerContext`, and writes RUN_DIR/result.json. Stage announcements go to
RUN_DIR/progress.jsonl as they happen so that the parent can say where a child that hung or died was.

Only entries inside the `maxkernel` package can be called: the job file is written by the agent, but
nothing the candidate writes into the run dir should be able to redirect it.

The audit hook installed by `WorkerContext.guard` names violations (a socket, a subprocess, a write outside
the run dir) so the report says what was tried; it is *not* the wall. Code in the same interpreter can get
past it (ctypes calls libc directly), so containment is the sandbox's job (see `sandbox`), and a verdict
is never computed in a process that imports a candidate (see `harness`).

If the worker cannot even import what the job needs (`job["preload"]`, e.g. jax), that is reported as an
infrastructure failure, which the harness never stores as a verdict.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

_BLOCKED_EVENTS: dict[str, str] = {
    "socket.__new__": "opened a socket",
    "socket.connect": "connected a socket",
    "socket.bind": "bound a socket",
    "socket.getaddrinfo": "resolved a network address",
    "subprocess.Popen": "started a subprocess",
    "os.system": "ran a shell command",
    "os.exec": "exec'd a program",
    "os.posix_spawn": "spawned a process",
    "os.spawn": "spawned a process",
    "os.fork": "forked the process",
    "os.forkpty": "forked the process",
    "pty.spawn": "spawned a terminal",
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_MUTATING_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate"}


OPTIONAL_IMPORTS = ("jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call",)
"""Modules JAX imports inside every Pallas interpret-mode lowering and tolerates missing (`pallas_call`'s
lowering catches the ImportError). When one cannot be imported here (the Mosaic GPU interpreter needs absl,
which this toolchain lacks), Python forgets the failure and re-executes the partial import on every
attempt: ~0.25 s per interpret-mode lowering, twice or more per evaluation. `settle_optional_imports`
tries each once and records a failure the way Python caches one."""


def settle_optional_imports(names: tuple[str, ...] = OPTIONAL_IMPORTS) -> dict[str, bool]:
    """Import each optional module once; one that fails becomes `sys.modules[name] = None`, so a later
    import raises ModuleNotFoundError at once, as the first did. Returns which ones are available."""
    available = {}
    for name in names:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except ImportError:
                sys.modules[name] = None  # type: ignore[assignment]
        available[name] = sys.modules.get(name) is not None
    return available


class SandboxViolation(PermissionError):
    """Raised inside the child when the code under test does something the sandbox forbids."""


class WorkerContext:
    """Handed to entry functions: where to write, and how to announce stages."""

    def __init__(self, run_dir: Path, secret: bytes = b"") -> None:
        self.run_dir = run_dir
        """Where job files are read and written; `.` once dropped to nobody (see `_drop_to_nobody`)."""
        self.guard_root = run_dir
        self.secret = secret
        """Per-run secret from the parent (trusted entries derive their private random draws from it)."""
        self.current_stage: str | None = None
        self.violations: list[str] = []
        self._progress = open(run_dir / "progress.jsonl", "a", buffering=1)  # noqa: SIM115
        self._guard_on = False

    def stage(self, name: str) -> None:
        self.current_stage = name
        self._emit({"stage": name})

    def _emit(self, event: dict[str, Any]) -> None:
        self._progress.write(json.dumps(event) + "\n")
        self._progress.flush()

    # --- the audit hook -------------------------------------------------------------------------------
    def guard(self) -> None:
        """Start refusing sockets, subprocesses and writes outside the run dir (cannot be undone)."""
        if not self._guard_on:
            self._guard_on = True
            blocked = dict(_BLOCKED_EVENTS)  # a private copy: clearing the module's table changes nothing
            audit = self._audit
            sys.addaudithook(lambda event, args: audit(event, args, blocked))

    def _allowed_write(self, path: Any) -> bool:
        if isinstance(path, int):
            return True  # an already-open descriptor; opening it was checked
        try:
            p = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        roots = (str(self.guard_root), "/dev/null")
        return any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots)

    def _violation(self, what: str) -> None:
        if what not in self.violations:
            self.violations.append(what)
            self._emit({"violation": what})
        raise SandboxViolation(f"maxkernel sandbox: {what} is not allowed")

    def _audit(self, event: str, args: tuple[Any, ...], blocked: dict[str, str]) -> None:
        if event in blocked:
            if event == "socket.__new__" and len(args) > 1 and args[1] == 1:  # AF_UNIX: local IPC only;
                return  # connecting it anywhere is still refused (socket.connect)
            self._violation(blocked[event])
        elif event == "open":
            path, mode, flags = (list(args) + [None, None, None])[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS
            )
            if writing and not self._allowed_write(path):
                self._violation(f"writing {os.fsdecode(path)!s} outside the run directory")
        elif event in _MUTATING_EVENTS:
            if args and not self._allowed_write(args[0]):
                self._violation(f"{event} on {os.fsdecode(args[0])!s} outside the run directory")


def _resolve(entry: str) -> Any:
    module_name, _, func_name = entry.partition(":")
    if not module_name.startswith("maxkernel.") or not func_name:
        raise ValueError(f"refusing to run entry {entry!r}: only maxkernel.* functions can be called")
    return getattr(importlib.import_module(module_name), func_name)


def _read_key() -> bytes:
    """The parent hands a one-time key through an inherited pipe, read before any untrusted code loads.

    Results are signed with it, so code under test that writes its own result.json and exits is caught.
    """
    fd_text = os.environ.pop("MAXKERNEL_KEY_FD", None)
    if fd_text is None:
        return b""
    fd = int(fd_text)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _drop_to_nobody() -> None:
    """Fallback mode under a root agent: become `nobody` once the interpreter and the job's modules are
    loaded (as root, because the interpreter may live where nobody cannot read, e.g. /root/.pyenv) and
    before any job code runs. The working directory (the run dir, owned by nobody) stays usable through
    relative paths even where its ancestors are not searchable. From here on: no /etc/shadow, no signals to root processes, no writes to
    root-owned files such as the results store."""
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)


def sign(key: bytes, body: str) -> str:
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def main(run_dir_arg: str) -> int:
    key = _read_key()
    run_dir = Path(run_dir_arg).resolve()
    job = json.loads((run_dir / "job.json").read_text())
    ctx = WorkerContext(run_dir, secret=key)
    ctx.stage("start")
    try:
        for name in job.get("preload", []):
            importlib.import_module(name)
        if "jax" in sys.modules:
            settle_optional_imports()
        func = _resolve(job["entry"])
        if os.environ.pop("MAXKERNEL_DROP_TO_NOBODY", None) == "1":
            _drop_to_nobody()
            # The run dir's ancestors may not be searchable by nobody (a 0700 temp dir): from here on every
            # path is relative to it (it is the working directory).
            run_dir = ctx.run_dir = Path(".")
    except Exception as exc:  # noqa: BLE001 - the environment, not the job, is broken
        result: dict[str, Any] = {
            "ok": False,
            "infrastructure": True,
            "error": f"{type(exc).__name__}: {exc}",
        }
        _write_result(run_dir, key, result)
        return 0
    try:
        value = func(job["payload"], ctx)
        result = {"ok": True, "value": value}
    except BaseException as exc:  # noqa: BLE001 - everything becomes a structured result
        tb = traceback.format_exc(limit=8)
        result = {
            "ok": False,
            "stage": ctx.current_stage,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": tb,
        }
    if ctx.violations and result.get("ok"):
        value = result.get("value") or {}
        value["_violations"] = list(ctx.violations)
        result["value"] = value
    _write_result(run_dir, key, result)
    return 0


def _write_result(run_dir: Path, key: bytes, result: dict[str, Any]) -> None:
    body = json.dumps(result, default=str)
    tmp = run_dir / "result.json.part"
    tmp.write_text(json.dumps({"body": body, "mac": sign(key, body)}))
    tmp.replace(run_dir / "result.json")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
