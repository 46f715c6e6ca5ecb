"""Checks on the production kernels in benchmarks/production/ (the suite's task format): every task's
CPU-scale inputs and reference run, are finite, and every dynamic input matters (perturbing it moves the
output beyond the task's tolerance); the model's shapes trace (jax.eval_shape: nothing allocated) to the
same structure, far larger; the README lists every task."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from test_suite_tasks import _differs, _leaves_f64, _perturb

PRODUCTION = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "production"
TASK_IDS = sorted(p.name for p in PRODUCTION.iterdir() if (p / "reference.py").is_file())


def _load(task_id: str):
    spec = importlib.util.spec_from_file_location(
        f"production_{task_id}", PRODUCTION / task_id / "reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    meta = yaml.safe_load((PRODUCTION / task_id / "kernel_task.yaml").read_text())
    return module, meta


def test_every_task_is_listed() -> None:
    assert len(TASK_IDS) >= 6
    readme = (PRODUCTION / "README.md").read_text()
    assert all(f"`{t}`" in readme for t in TASK_IDS)


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_cpu_scale_runs_and_every_input_matters(task_id: str) -> None:
    module, meta = _load(task_id)
    assert meta["task_id"] == task_id and meta["category"] == "production"
    dyn, static = module.get_inputs(scale="cpu")
    assert json.loads(json.dumps(static)) == static
    fn = jax.jit(lambda *d: module.computation(*d, *static))
    base = _leaves_f64(fn(*dyn))
    assert base and all(np.isfinite(x).all() for x in base)
    for i in range(len(dyn)):
        changed = list(dyn)
        changed[i] = _perturb(dyn[i], seed=4321 + i)
        assert _differs(base, _leaves_f64(fn(*changed)), meta["atol"], meta["rtol"]), f"input {i} is ignored"


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_the_models_shapes_trace(task_id: str) -> None:
    module, _meta = _load(task_id)
    shapes = {}
    for scale in ("cpu", "tpu"):
        holder = {}

        def make(scale=scale, holder=holder):
            dyn, static = module.get_inputs(scale=scale)
            holder["static"] = static
            return dyn

        dyn = jax.eval_shape(make)
        out = jax.eval_shape(lambda *d, s=holder: module.computation(*d, *s["static"]), *dyn)
        shapes[scale] = (dyn, out)
    (cpu_in, cpu_out), (tpu_in, tpu_out) = shapes["cpu"], shapes["tpu"]
    assert [a.dtype for a in cpu_in] == [a.dtype for a in tpu_in]
    nbytes = [sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in xs) for xs in (cpu_in, tpu_in)]
    assert nbytes[1] >= 16 * nbytes[0]
    assert jax.tree_util.tree_structure(cpu_out) == jax.tree_util.tree_structure(tpu_out)
