"""A chained-matmul (MLP) kernel over an (N, H, W, C) activation tiles the merged N * H * W rows, not W
alone with N x H grid steps: a ConvNeXt MLP at 128 x 56 x 56 walked 7168 steps of 56 rows, its step
overhead dominating. Rows shared with an operand that spans only some of them (a per-position term) stay
split. Correct in TPU interpret mode on aligned and odd shapes, and compiles for v5e and v6e ahead of time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.render import render, undefined_names
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.estimate import estimate_pallas, topology_device

TPU = ["v5e", "v6e"]


def mlp_residual(x, w1, b1, w2, skip):
    """The MLP half of a ConvNeXt block: `x` the normalised activation, `skip` the block's input."""
    f32 = jnp.float32
    h = jnp.dot(x, w1, preferred_element_type=f32) + b1.astype(f32)
    h = jax.nn.gelu(h, approximate=False).astype(x.dtype)
    y = jnp.dot(h, w2, preferred_element_type=f32)
    return (skip.astype(f32) + y).astype(x.dtype)


def mlp_positional(x, w1, w2, pos):
    """The result varies with a per-(H, W) term: only the rows it spans alike may merge."""
    f32 = jnp.float32
    h = jax.nn.relu(jnp.dot(x, w1, preferred_element_type=f32)).astype(x.dtype)
    return (jnp.dot(h, w2, preferred_element_type=f32) + pos.astype(f32)).astype(x.dtype)


# the large shape first (it sets the extents the tiles are chosen for), then an aligned and an odd one
SHAPES = [(16, 28, 28, 128), (2, 4, 8, 128), (3, 5, 7, 128)]


def _kernel(fn, configs, names):
    program = lower_program(trace_reference(fn, configs, names), "t")
    assert [k.family for k in program.kernels] == ["fused_mlp"]
    config = default_config(program, TPU)
    src = render(program, config, TPU)
    assert undefined_names(src) == []
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    return program, ns["computation"]


def _args(rng, x_shape, extra):
    c = x_shape[-1]
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((c, 4 * c)) * c**-0.5, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((4 * c, c)) * (4 * c) ** -0.5, jnp.bfloat16)
    return x, w1, w2, jnp.asarray(0.2 * rng.standard_normal(extra), jnp.bfloat16)


def _close(got, want) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=5e-2, rtol=2e-2
    )


def test_mlp_rows_merge_into_one_tiled_dim_and_stay_correct() -> None:
    configs = [
        Config(
            dynamic=[
                (s, "bfloat16"),
                ((128, 512), "bfloat16"),
                ((512,), "bfloat16"),
                ((512, 128), "bfloat16"),
                (s, "bfloat16"),
            ],
            static=[],
        )
        for s in SHAPES
    ]
    program, kernel = _kernel(mlp_residual, configs, ["x", "w1", "b1", "w2", "skip"])
    (spec,) = program.kernels
    # one row axis walks N * H * W in blocks: no grid axis per batch element or image row
    assert [a.extent for a in spec.grid if a.param is not None and "Q" in a.param] == [16 * 28 * 28]
    assert not [a for a in spec.grid if a.param is None]
    big = [
        jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in (SHAPES[0], (128, 512), (512,), (512, 128), SHAPES[0])
    ]
    (call,) = estimate_pallas(jax.make_jaxpr(kernel)(*big), "v6e").pallas_calls
    assert call.est_grid_steps < 16 * 28  # was N x H = 448 steps of 28 rows
    rng = np.random.default_rng(5)
    for shape in SHAPES[1:]:
        x, w1, w2, b1 = _args(rng, shape, (512,))
        skip = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        with pltpu.force_tpu_interpret_mode():
            got = kernel(x, w1, b1, w2, skip)
        _close(got, mlp_residual(x, w1, b1, w2, skip))
    for gen in TPU:
        sharding = jax.sharding.SingleDeviceSharding(topology_device(gen))
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in big]
        jax.jit(kernel).trace(*avals).lower().compile()


def test_rows_an_operand_spans_in_part_stay_split() -> None:
    configs = [
        Config(
            dynamic=[
                (s, "bfloat16"),
                ((128, 512), "bfloat16"),
                ((512, 128), "bfloat16"),
                (s[1:], "bfloat16"),
            ],
            static=[],
        )
        for s in SHAPES[1:]
    ]
    program, kernel = _kernel(mlp_positional, configs, ["x", "w1", "w2", "pos"])
    (spec,) = program.kernels
    # H * W merge (every operand spans both or neither); the batch, which `pos` lacks, stays apart
    assert [a.extent for a in spec.grid if a.param is not None and "Q" in a.param] == [4 * 8]
    rng = np.random.default_rng(6)
    for shape in SHAPES[1:]:
        x, w1, w2, pos = _args(rng, shape, shape[1:])
        with pltpu.force_tpu_interpret_mode():
            got = kernel(x, w1, w2, pos)
        _close(got, mlp_positional(x, w1, w2, pos))
