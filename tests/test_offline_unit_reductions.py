"""A reduction over axes of size 1 (`(x @ w).sum(-1)` with a one-column weight: a gate, a scorer) sums
nothing: it is rewritten as a reshape, layout the matmul's kernel absorbs, so the matmul and everything after
it are one kernel. As a reduction it started a region of its own (two kernels and an HBM round trip of the
matmul result). Correct in TPU interpret mode, nothing moves outside the kernel at the task's shapes, and
compiled for v5e ahead of time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.partition import FUSION_LEVELS
from maxkernel.authors.offline.render import render
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.estimate import estimate_pallas, topology_device

TPU = ["v5e"]


def gate(x, w, b):
    """One output feature per row (a scorer), summed over its unit axis, then a sigmoid."""
    return jax.nn.sigmoid((x @ w + b).sum(axis=-1))


def unit_max(x, w):
    """A max over a unit middle axis of a batched product."""
    return jnp.max((x @ w)[:, None, :], axis=1) * 2.0


@pytest.mark.parametrize(
    ("fn", "shapes"),
    [
        (gate, lambda m, k: [(m, k), (k, 1), (1,)]),
        (unit_max, lambda m, k: [(m, k), (k, 256)]),
    ],
)
def test_a_reduction_over_unit_axes_is_layout_in_the_producers_kernel(fn, shapes) -> None:
    names = ["x", "w", "b"][: len(shapes(8, 8))]

    def cfg(m: int, k: int) -> Config:
        return Config(dynamic=[(s, "float32") for s in shapes(m, k)], static=[])

    configs = [cfg(1024, 512), cfg(64, 128), cfg(40, 136)]
    program = lower_program(trace_reference(fn, configs, names), "t", FUSION_LEVELS[0])
    assert len(program.kernels) == 1, [k.name for k in program.kernels]
    src = render(program, default_config(program, TPU), TPU)
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    rng = np.random.default_rng(0)
    for m, k in [(64, 128), (40, 136)]:
        args = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes(m, k)]
        with pltpu.force_tpu_interpret_mode():
            got = np.asarray(ns["computation"](*args))
        np.testing.assert_allclose(got, np.asarray(fn(*args)), atol=2e-4 * np.sqrt(k), rtol=1e-4)
    sharding = jax.sharding.SingleDeviceSharding(topology_device("v5e"))
    avals = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding) for s in shapes(1024, 512)]
    est = estimate_pallas(jax.make_jaxpr(ns["computation"])(*avals), "v5e")
    assert est.est_xla_bytes == 0
    jax.jit(ns["computation"]).trace(*avals).lower().compile()
