"""Reference work cached across candidates (the task's description and the compiler's estimate of the
reference) is keyed by the task's content: an edited task must never be served the old task's numbers."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np

from maxkernel.tools.candidate import input_name
from maxkernel.tools.readback import pack_arrays
from maxkernel.tools.reference_cache import ReferenceEstimates, TaskInputCache
from maxkernel.tools.store import ResultsStore
from maxkernel.tools.tasks import KernelTask, load_task


def test_a_changed_task_invalidates_cached_reference_work(data_dir: Path, tmp_path: Path) -> None:
    task_dir = tmp_path / "task"
    shutil.copytree(data_dir / "tasks" / "small_matmul", task_dir)
    work = tmp_path / "work"
    store = ResultsStore(tmp_path / "results.db")
    first = load_task(task_dir, work_dir=work)
    store.put_reference_estimate(first.fingerprint, "v5e", 1.25)
    assert load_task(task_dir, work_dir=work).fingerprint == first.fingerprint  # served from the cache
    assert store.get_reference_estimate(first.fingerprint, "v5e") == 1.25
    in_memory = ReferenceEstimates()  # the same, for evaluations without a store
    in_memory.put(first, "v5e", 1.25)
    assert in_memory.get(first, "v5e") == 1.25 and in_memory.get(first, "v6e") is None

    ref = task_dir / "reference.py"
    text = ref.read_text()
    assert "return jax.nn.relu(" in text
    ref.write_text(
        text.replace("return jax.nn.relu(", "return 2.0 * jax.nn.relu(")
    )  # same shapes, other values
    changed = load_task(task_dir, work_dir=work)
    assert changed.fingerprint != first.fingerprint
    assert store.get_reference_estimate(changed.fingerprint, "v5e") is None  # recomputed, not served
    assert in_memory.get(changed, "v5e") is None
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


def _inputs_npz(task: KernelTask, fill: float) -> bytes:
    """An `inputs.npz` as the judge writes it: every config's sets 0 and 1, each array filled with `fill`."""
    return pack_arrays(
        {
            input_name(ci, si, k): np.full(spec.shape, fill + si, np.dtype(spec.dtype))
            for ci, cfg in enumerate(task.validation_configs)
            for si in range(2)
            for k, spec in enumerate(cfg.dynamic)
        }
    )


def test_a_changed_task_is_never_served_the_old_task_inputs(data_dir: Path, tmp_path: Path) -> None:
    task_dir = tmp_path / "task"
    shutil.copytree(data_dir / "tasks" / "small_matmul", task_dir)
    first = load_task(task_dir, work_dir=tmp_path / "work")
    cache = TaskInputCache()
    origins = [["task", "random"] for _ in first.validation_configs]
    assert cache.get(first) is None
    assert cache.learn(first, _inputs_npz(first, 1.0), origins)
    with np.load(io.BytesIO(cache.get(first) or b""), allow_pickle=False) as z:
        # Only the task's own set is kept (set 0), never a secret draw (set 1).
        assert sorted(z.files) == sorted(
            input_name(ci, 0, k)
            for ci, c in enumerate(first.validation_configs)
            for k in range(len(c.dynamic))
        )
        assert all(float(z[n].max()) == 1.0 for n in z.files)

    ref = task_dir / "reference.py"
    ref.write_text(ref.read_text().replace("return jax.nn.relu(", "return 2.0 * jax.nn.relu("))
    changed = load_task(task_dir, work_dir=tmp_path / "work")
    assert changed.fingerprint != first.fingerprint
    assert cache.get(changed) is None  # recomputed by the changed task's judge, not served
    assert cache.get(first) is not None


def test_only_the_task_labelled_sets_with_the_right_shapes_are_cached(data_dir: Path, tmp_path: Path) -> None:
    task = load_task(data_dir / "tasks" / "small_matmul", work_dir=tmp_path / "work")
    cache = TaskInputCache()
    drawn = [["random", "random"] for _ in task.validation_configs]  # e.g. shrunk shapes: set 0 is secret
    assert not cache.learn(task, _inputs_npz(task, 1.0), drawn)
    wrong = pack_arrays({input_name(0, 0, 0): np.zeros((3, 3), np.float32)})
    assert not cache.learn(task, wrong, [["task", "random"] for _ in task.validation_configs])
    assert cache.get(task) is None
