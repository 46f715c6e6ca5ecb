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


def test_a_changed_estimator_invalidates_cached_estimates(tmp_path: Path, monkeypatch) -> None:
    """Stored estimates are keyed by the estimators' source too: a reference estimate from before the loop
    pricing (one iteration of a lax.map) was served long after it, off by the loop's trip count."""
    from maxkernel.tools import store as store_mod

    store = ResultsStore(tmp_path / "results.db")
    store.put_reference_estimate("fp", "v5e", 1.25)
    key = store_mod.evaluation_key("fp", "src", {})
    assert store.get_reference_estimate("fp", "v5e") == 1.25
    monkeypatch.setattr(store_mod, "harness_fingerprint", lambda: "a different block model")
    assert store.get_reference_estimate("fp", "v5e") is None
    assert store_mod.evaluation_key("fp", "src", {}) != key
    # the real fingerprint reads the estimator modules themselves
    monkeypatch.undo()
    assert len(store_mod.harness_fingerprint()) == 16
    for name in ("estimate.py", "loop_pricing.py", "tpu_specs.py", "jaxpr.py"):
        assert (Path(store_mod.__file__).parent / name).is_file()
