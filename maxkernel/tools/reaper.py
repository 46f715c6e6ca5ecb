"""`python -m maxkernel.tools.reaper [options] -- CMD...`: the parent every sandboxed child runs under.

It exists because a process group is not a cage: a child that calls `setsid()` (or double-forks) leaves its
group, and `killpg` then misses it. The reaper makes itself a *child subreaper* (prctl), so every orphaned
descendant is re-parented to it however it detached, starts CMD in a new session with rlimits (address
space, file size, core dumps, open files). (Dropping to `nobody` happens in the worker itself, after its
modules are loaded: see `worker._drop_to_nobody`.) When CMD
exits, times out, or the reaper is told to stop (SIGTERM, or its own parent dying), it kills every
descendant it can still see until none is left, then exits with CMD's status (124 on timeout).

Only the standard library is imported: it starts in milliseconds, and no candidate code ever runs in it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
EXIT_TIMEOUT = 124

_stop = False


def _prctl(option: int, value: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _children(pid: int) -> list[int]:
    """Direct children of `pid` (orphans re-parented to a subreaper show up here too)."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid ... ; comm may contain spaces and parentheses: split after the last ')'.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            out.append(int(name))
    return out


def kill_descendants() -> int:
    """SIGKILL every descendant until none is left (each killed process's children come back to us)."""
    me = os.getpid()
    killed = 0
    for _ in range(500):
        kids = _children(me)
        if not kids:
            break
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.005)
    return killed


def set_limit(which: int, value: int) -> int:
    """Set both the soft and the hard limit of `which` to `value`, or to the hard limit this process already
    has where that is lower: a limit can only be lowered without privilege, and an agent run under a tighter
    `ulimit` (say `ulimit -v` on a shared machine) must still start its children, under the tighter limit.
    Returns the limit set."""
    _soft, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))
    return value


def _preexec(memory_mb: int, fsize_mb: int) -> None:
    os.setsid()
    set_limit(resource.RLIMIT_CORE, 0)
    if memory_mb > 0:
        set_limit(resource.RLIMIT_AS, memory_mb << 20)
    if fsize_mb > 0:
        set_limit(resource.RLIMIT_FSIZE, fsize_mb << 20)
    set_limit(resource.RLIMIT_NOFILE, 4096)


def _on_term(_sig: int, _frame: object) -> None:
    global _stop
    _stop = True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="maxkernel.tools.reaper")
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--memory-mb", type=int, default=0)
    parser.add_argument("--fsize-mb", type=int, default=0)
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # never ours: only the child is capped
    proc = subprocess.Popen(
        cmd,
        preexec_fn=lambda: _preexec(args.memory_mb, args.fsize_mb),
        pass_fds=tuple(int(fd) for fd in os.environ.get("MAXKERNEL_PASS_FDS", "").split(",") if fd),
        restore_signals=True,
    )
    deadline = time.monotonic() + args.timeout
    code: int | None = None
    while not _stop:
        code = proc.poll()
        if code is not None or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    timed_out = code is None
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    kill_descendants()
    if timed_out:
        return EXIT_TIMEOUT
    return 128 - code if code is not None and code < 0 else int(code or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
