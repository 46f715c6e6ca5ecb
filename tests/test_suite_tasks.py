"""Checks on the benchmark suite in benchmarks/suite/ (MaxKernel task format).

CPU scale: every task's inputs and reference run, are finite and non-degenerate, and every dynamic
input matters (perturbing it moves the output beyond the task's tolerance). TPU scale: traced with
jax.eval_shape only, nothing is allocated.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

SUITE = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "suite"
TASK_IDS = sorted(p.name for p in SUITE.iterdir() if p.is_dir() and p.name[0] not in "._")
YAML_KEYS = {"task_id", "description", "category", "input_gen_code", "atol", "rtol"}
CPU_MAX_ELEMENTS = 1_500_000
TPU_MIN_BYTES = 16 * 2**20
TPU_MAX_BYTES = 4 * 2**30


@functools.cache
def load_reference(task_id: str):
    path = SUITE / task_id / "reference.py"
    spec = importlib.util.spec_from_file_location(f"suite_reference_{task_id}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def load_yaml(task_id: str) -> dict:
    return yaml.safe_load((SUITE / task_id / "kernel_task.yaml").read_text())


def _nbytes(arrays) -> int:
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays)


def _leaves_f64(out) -> list[np.ndarray]:
    # numpy (with ml_dtypes for bf16) does the conversions: no per-shape XLA compiles.
    return [np.asarray(x).astype(np.float64) for x in jax.tree_util.tree_leaves(out)]


def _differs(a, b, atol: float, rtol: float) -> bool:
    return any(not np.allclose(x, y, atol=atol, rtol=rtol) for x, y in zip(a, b, strict=True))


def _perturb(x: jax.Array, seed: int) -> jax.Array:
    """A nearby valid input: floats get noise of ~25% of their spread; integer inputs are shuffled,
    which keeps every value (ranges, sums of group sizes, page ids) inside its valid set."""
    rng = np.random.default_rng(seed)
    xn = np.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating):
        xf = xn.astype(np.float32)
        spread = float(np.std(xf) + np.mean(np.abs(xf)))
        noisy = xf + 0.25 * spread * rng.standard_normal(xf.shape, dtype=np.float32)
        return jnp.asarray(noisy.astype(xn.dtype))
    for _ in range(20):
        y = rng.permutation(xn.reshape(-1)).reshape(xn.shape)
        if np.any(y != xn):
            return jnp.asarray(y)
    raise AssertionError(f"integer input {x.dtype}{x.shape} is constant: shuffling cannot change it")


def test_suite_size_and_categories():
    assert len(TASK_IDS) >= 50, TASK_IDS
    cats = [load_yaml(t)["category"] for t in TASK_IDS]
    assert cats.count("operator") >= 17
    assert cats.count("fused") >= 33
    assert set(cats) <= {"operator", "fused"}


def test_readme_lists_every_task():
    readme = (SUITE / "README.md").read_text()
    for task_id in TASK_IDS:
        assert f"`{task_id}`" in readme, task_id


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_task_files(task_id):
    assert (SUITE / task_id / "reference.py").is_file()
    meta = load_yaml(task_id)
    assert set(meta) >= YAML_KEYS, YAML_KEYS - set(meta)
    assert meta["task_id"] == task_id
    assert meta["category"] in {"operator", "fused"}
    assert meta["category"] == ("operator" if task_id.startswith("op_") else "fused")
    assert isinstance(meta["description"], str) and len(meta["description"]) > 20
    for key in ("atol", "rtol"):
        assert isinstance(meta[key], float) and 0 < meta[key] < 1, (key, meta[key])

    module = load_reference(task_id)
    assert meta["input_gen_code"] == inspect.getsource(module.get_inputs)
    params = inspect.signature(module.get_inputs).parameters
    assert list(params) == ["dtype", "scale"]
    assert params["scale"].default == "tpu"
    assert params["dtype"].default in (jnp.bfloat16, jnp.float32)


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_cpu_scale(task_id):
    module = load_reference(task_id)
    meta = load_yaml(task_id)
    atol, rtol = meta["atol"], meta["rtol"]
    dyn, static = module.get_inputs(scale="cpu")

    # Inputs: jax arrays, JSON-serialisable statics, small, deterministic, non-degenerate.
    assert isinstance(dyn, list) and isinstance(static, list) and dyn
    assert all(isinstance(a, jax.Array) for a in dyn)
    assert all(type(v) in (int, float, bool, str) for v in static), static
    assert json.loads(json.dumps(static)) == static
    assert sum(a.size for a in dyn) <= CPU_MAX_ELEMENTS
    n_params = len(inspect.signature(module.computation).parameters)
    assert n_params == len(dyn) + len(static)
    host = [np.asarray(a) for a in dyn]
    for i, a in enumerate(host):
        if jnp.issubdtype(a.dtype, jnp.floating):
            af = a.astype(np.float32)
            assert np.isfinite(af).all(), f"input {i} not finite"
            assert np.any(af != 0), f"input {i} is all zeros"
            assert af.max() > af.min(), f"input {i} is constant"
        else:
            assert jnp.issubdtype(a.dtype, jnp.integer), a.dtype
    again, static_again = module.get_inputs(scale="cpu")
    assert static_again == static
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(host, again, strict=True))

    # input_gen_code runs on its own (it only needs jnp for its dtype default).
    namespace = {"jnp": jnp}
    exec(meta["input_gen_code"], namespace)  # noqa: S102
    standalone, _ = namespace["get_inputs"](scale="cpu")
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(host, standalone, strict=True))

    fn = jax.jit(lambda *d: module.computation(*d, *static))
    base = _leaves_f64(fn(*dyn))
    assert base and all(np.isfinite(x).all() for x in base)
    assert not _differs(base, _leaves_f64(fn(*dyn)), 0.0, 0.0), "computation is not deterministic"

    # Every dynamic input matters.
    for i in range(len(dyn)):
        changed = list(dyn)
        changed[i] = _perturb(dyn[i], seed=1234 + i)
        out = _leaves_f64(fn(*changed))
        assert all(np.isfinite(x).all() for x in out), f"perturbing input {i} gave non-finite output"
        assert _differs(base, out, atol, rtol), f"output does not depend on dynamic input {i}"


def _abstract(module, scale: str):
    """(input shapes, statics, output shapes) of a task at `scale`, without allocating anything."""
    holder = {}

    def make_inputs():
        dyn, static = module.get_inputs(scale=scale)
        holder["static"] = static
        return dyn

    dyn = jax.eval_shape(make_inputs)
    static = holder["static"]
    out = jax.eval_shape(lambda *d: module.computation(*d, *static), *dyn)
    return dyn, static, out


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_tpu_scale_traces(task_id):
    module = load_reference(task_id)
    tpu_dyn, tpu_static, tpu_out = _abstract(module, "tpu")
    cpu_dyn, cpu_static, cpu_out = _abstract(module, "cpu")
    assert json.loads(json.dumps(tpu_static)) == tpu_static
    assert len(tpu_static) == len(cpu_static)

    assert len(tpu_dyn) == len(cpu_dyn)
    for t, c in zip(tpu_dyn, cpu_dyn, strict=True):
        assert t.dtype == c.dtype and len(t.shape) == len(c.shape), (t, c)
    tpu_bytes, cpu_bytes = _nbytes(tpu_dyn), _nbytes(cpu_dyn)
    assert tpu_bytes >= 16 * cpu_bytes, (tpu_bytes, cpu_bytes)
    assert TPU_MIN_BYTES <= tpu_bytes <= TPU_MAX_BYTES, tpu_bytes

    assert jax.tree_util.tree_structure(tpu_out) == jax.tree_util.tree_structure(cpu_out)
    for t, c in zip(jax.tree_util.tree_leaves(tpu_out), jax.tree_util.tree_leaves(cpu_out), strict=True):
        assert t.dtype == c.dtype and len(t.shape) == len(c.shape), (t, c)
        assert math.prod(t.shape) >= math.prod(c.shape) > 0, (t, c)


def test_generated_files_are_current():
    """kernel_task.yaml files and README.md match generate_yaml.py's table and the references."""
    spec = importlib.util.spec_from_file_location("suite_generate_yaml", SUITE / "generate_yaml.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert sorted(gen.TASKS) == TASK_IDS
    assert gen.main(["--check"]) == 0, "run: python benchmarks/suite/generate_yaml.py"
