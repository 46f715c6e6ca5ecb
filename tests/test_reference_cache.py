"""Reference work cached across candidates (the task's description and the compiler's estimate of the
reference) is keyed by the task's content: an edited task must never be served the old task's numbers."""

from __future__ import annotations

import shutil
from pathlib import Path

from maxkernel.tools.store import ResultsStore
from maxkernel.tools.tasks import load_task


def test_a_changed_task_invalidates_cached_reference_work(data_dir: Path, tmp_path: Path) -> None:
    task_dir = tmp_path / "task"
    shutil.copytree(data_dir / "tasks" / "small_matmul", task_dir)
    work = tmp_path / "work"
    store = ResultsStore(tmp_path / "results.db")
    first = load_task(task_dir, work_dir=work)
    store.put_reference_estimate(first.fingerprint, "v5e", 1.25)
    assert load_task(task_dir, work_dir=work).fingerprint == first.fingerprint  # served from the cache
    assert store.get_reference_estimate(first.fingerprint, "v5e") == 1.25

    ref = task_dir / "reference.py"
    text = ref.read_text()
    assert "return jax.nn.relu(" in text
    ref.write_text(
        text.replace("return jax.nn.relu(", "return 2.0 * jax.nn.relu(")
    )  # same shapes, other values
    changed = load_task(task_dir, work_dir=work)
    assert changed.fingerprint != first.fingerprint
    assert store.get_reference_estimate(changed.fingerprint, "v5e") is None  # recomputed, not served
    assert store.get_reference_estimate(first.fingerprint, "v5e") == 1.25
