"""An elementwise chain whose operands all span the same axes is tiled as (rows, lanes), not flattened into
one (1, n) row: a (1, n) block fills one sublane of eight and walks n / BLOCK_COLS grid steps (issue 12)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.render import render, undefined_names
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.estimate import estimate_pallas, topology_device

TPU = ["v5e", "v6e"]


def silu_up(x, y):
    return jax.nn.silu(x) * y


@pytest.mark.parametrize(
    ("big", "odd"),
    [((2048, 1024), (96, 136)), ((16, 256, 512), (3, 7, 130))],
)
def test_elementwise_blocks_are_row_by_lane_tiles(big, odd) -> None:
    configs = [Config(dynamic=[(s, "float32")] * 2, static=[]) for s in (big, odd)]
    program = lower_program(trace_reference(silu_up, configs, ["x", "y"]), "t")
    src = render(program, default_config(program, TPU), TPU)
    assert undefined_names(src) == []
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    kernel = ns["computation"]
    rng = np.random.default_rng(0)
    for shape in (big, odd):
        x, y = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
        with pltpu.force_tpu_interpret_mode():
            got = kernel(x, y)
        np.testing.assert_allclose(np.asarray(got), np.asarray(silu_up(x, y)), atol=1e-6, rtol=1e-6)
    sds = [jax.ShapeDtypeStruct(big, jnp.float32)] * 2
    est = estimate_pallas(jax.make_jaxpr(kernel)(*sds), "v5e")
    (call,) = est.pallas_calls
    # whole vreg tiles of ~1 MiB: a handful of steps, where one (1, 1024) row per step took thousands
    assert call.est_grid_steps <= np.prod(big) // (8 * 1024), call.est_grid_steps
    for gen in TPU:
        sharding = jax.sharding.SingleDeviceSharding(topology_device(gen))
        avals = [jax.ShapeDtypeStruct(big, jnp.float32, sharding=sharding)] * 2
        jax.jit(kernel).trace(*avals).lower().compile()
