"""A bench stopped with SIGTERM (`kill PID`, a container stop) ends its child runs too. It used to end alone:
each task's `maxkernel optimize` went on as an orphan, with its sandboxed jobs, until it finished."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from maxkernel.bench import Children, StoppedError

SCRIPT = textwrap.dedent(
    """
    import subprocess, sys, threading
    from maxkernel.bench import Children, _stop_children_on_sigterm

    children = Children()
    def one():
        children.run([sys.executable, "-c", "import time; time.sleep(120)"], timeout=None)
    with _stop_children_on_sigterm(children):
        threads = [threading.Thread(target=one, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        while len(children.procs) < 2:
            threading.Event().wait(0.05)
        print(" ".join(str(p.pid) for p in children.procs), flush=True)
        threading.Event().wait(120)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def test_sigterm_ends_the_child_runs_in_flight() -> None:
    bench = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in bench.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)
    finally:
        if bench.poll() is None:
            bench.kill()


def test_a_stopping_bench_starts_no_new_child() -> None:
    children = Children()
    children.stop()
    try:
        children.run([sys.executable, "-c", "pass"], timeout=10)
    except StoppedError:
        pass
    else:
        raise AssertionError("a child started after stop()")


def test_a_timed_out_child_is_ended_and_reported() -> None:
    children = Children()
    children.GRACE_S = 5.0
    t0 = time.monotonic()
    try:
        children.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)
    except subprocess.TimeoutExpired:
        pass
    else:
        raise AssertionError("no timeout")
    assert time.monotonic() - t0 < 30 and not children.procs
