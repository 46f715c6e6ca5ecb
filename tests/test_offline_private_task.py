"""A root agent without bubblewrap (a container) plans a task kept in a private folder: the offline author's
analysis runs the task's own code, as the judge does, so its child keeps the agent's user instead of
dropping to `nobody`, who cannot read the folder (before: "importing reference.py failed:
PermissionError" and every task was unsupported)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_offline_author import make_task

from maxkernel.authors.base import AuthorContext
from maxkernel.authors.offline import OfflineAuthor
from maxkernel.tools import sandbox
from maxkernel.tools.tasks import load_task


@pytest.mark.skipif(os.geteuid() != 0, reason="the drop to nobody only happens for a root agent")
def test_root_without_bubblewrap_plans_a_task_in_a_private_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sandbox, "bubblewrap_path", lambda: None)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    body = "def computation(x, y):\n    return jnp.tanh(x) * y\n\n\ndef get_inputs():\n"
    body += "    return [jnp.ones((64, 256), jnp.float32), jnp.ones((64, 256), jnp.float32)], []\n"
    task = load_task(make_task(private / "tasks", "tanh_mul", body), work_dir=private / "work")
    plan = OfflineAuthor().plan(AuthorContext(task=task, tpu=["v5e"], work_dir=private / "work"))
    assert plan.supported, plan.unsupported_reason
