"""Sandboxed children under an agent that already runs with tighter limits (`ulimit -v`, `ulimit -n` on a
shared machine): a child can only be given a limit at or below the agent's own hard limit, so it gets the
tighter one instead of failing to start ("Exception occurred in preexec_fn")."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from maxkernel.tools import sandbox
from maxkernel.tools.reaper import set_limit


def test_set_limit_never_asks_above_the_hard_limit() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a child: lowering a hard limit cannot be undone in the process that does it
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (512, 1024))
            got_high = set_limit(resource.RLIMIT_NOFILE, 4096)
            after_high = resource.getrlimit(resource.RLIMIT_NOFILE)
            got_low = set_limit(resource.RLIMIT_NOFILE, 256)
            after_low = resource.getrlimit(resource.RLIMIT_NOFILE)
            os.write(write, json.dumps([got_high, after_high, got_low, after_low]).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    got_high, after_high, got_low, after_low = json.loads(os.read(read, 4096))
    os.close(read)
    assert got_high == 1024 and after_high == [1024, 1024]  # capped at the hard limit, not an error
    assert got_low == 256 and after_low == [256, 256]  # a lower request is honoured


SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    from pathlib import Path
    from maxkernel.tools.sandbox import SandboxedChild, SandboxLimits, fresh_run_dir

    root = Path(sys.argv[1])
    out = {}
    for name, zygote_root in [("spawned", None), ("zygote", root / "evals")]:
        run_dir = fresh_run_dir(root / "evals" if zygote_root else root / "spawned", "probe")
        child = SandboxedChild("maxkernel.tools.zygote:probe_job", {}, run_dir, SandboxLimits(timeout_s=180),
                               zygote_root=zygote_root)
        child.start()
        res = child.wait()
        out[name] = {"ok": res.ok, "via_zygote": child.via_zygote, "error": res.error,
                     "stderr": (res.stderr_tail or "")[-400:], "sum": (res.value or {}).get("sum")}
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(sandbox.isolation_available() == "none", reason="no sandbox on this machine")
def test_children_start_under_an_agent_with_a_lower_hard_limit(tmp_path: Path) -> None:
    def lower_open_files() -> None:  # below the 4096 open files a sandboxed child is given
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, 2048))

    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=600, preexec_fn=lower_open_files)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, res in out.items():
        assert res["ok"] and res["sum"] == 3.0, (name, res)
    if sandbox.isolation_available() == "bubblewrap":
        assert out["zygote"]["via_zygote"]  # forked by the zygote, not its spawning fallback
