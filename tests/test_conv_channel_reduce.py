"""Reductions over the channels after a convolution (a softmax or a layer norm over C) run in the conv
kernel's epilogue: the kernel takes every output channel in one block (the whole dim, so no padded lane
enters a sum or a max), reduces each pixel's row of the f32 accumulator in VMEM and applies the rest of the
chain before its one store. Without it the conv's f32 output makes an HBM round trip into a row-wise kernel.
Correct in TPU interpret mode on aligned and odd shapes, compiled for v5e and v6e ahead of time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import tpu as pltpu

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.render import render, undefined_names
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.estimate import topology_device

TPU = ["v5e", "v6e"]


def conv3d_softmax(x, w, b):
    f32 = jnp.float32
    y = lax.conv_general_dilated(
        x, w, (1, 1, 1), "SAME", dimension_numbers=("NDHWC", "DHWIO", "NDHWC"), preferred_element_type=f32
    ) + b.astype(f32)
    return jax.nn.softmax(y, axis=-1).astype(x.dtype)


def depthwise_layernorm(x, w, b, g, beta):
    f32 = jnp.float32
    y = lax.conv_general_dilated(
        x,
        w,
        (1, 1),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=x.shape[-1],
        preferred_element_type=f32,
    ) + b.astype(f32)
    mean = jnp.mean(y, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(y - mean), axis=-1, keepdims=True)
    return ((y - mean) * lax.rsqrt(var + 1e-6) * g.astype(f32) + beta.astype(f32)).astype(x.dtype)


CASES = [
    # (fn, arg names, shapes per config: task-size first, then an aligned and an odd one)
    (
        conv3d_softmax,
        ["x", "w", "b"],
        [
            ((8, 32, 64, 64, 32), (3, 3, 3, 32, 64), (64,)),
            ((1, 4, 8, 16, 32), (3, 3, 3, 32, 64), (64,)),
            ((2, 3, 5, 7, 5), (3, 3, 3, 5, 3), (3,)),
        ],
    ),
    (
        depthwise_layernorm,
        ["x", "w", "b", "g", "beta"],
        [
            ((128, 56, 56, 128), (7, 7, 1, 128), (128,), (128,), (128,)),
            ((1, 8, 16, 128), (7, 7, 1, 128), (128,), (128,), (128,)),
            ((2, 7, 9, 128), (7, 7, 1, 128), (128,), (128,), (128,)),  # the mean's 1/C stays one literal
        ],
    ),
]


@pytest.mark.parametrize(("fn", "names", "shapes"), CASES, ids=["conv3d_softmax", "depthwise_layernorm"])
def test_channel_reduction_in_the_conv_epilogue(fn, names, shapes) -> None:
    configs = [Config(dynamic=[(s, "bfloat16") for s in case], static=[]) for case in shapes]
    program = lower_program(trace_reference(fn, configs, names, direct_conv=True), "t")
    assert [k.family for k in program.kernels] == ["conv"]  # no row-wise kernel reading the conv output back
    code = program.kernels[0].code
    assert "axis=-1, keepdims=True" in code and "bo = n_out  # every channel in one block" in code
    src = render(program, default_config(program, TPU), TPU)
    assert undefined_names(src) == []
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    kernel = ns["computation"]
    rng = np.random.default_rng(11)
    for case in shapes[1:]:
        args = [jnp.asarray(0.5 * rng.standard_normal(s), jnp.bfloat16) for s in case]
        with pltpu.force_tpu_interpret_mode():
            got = kernel(*args)
        want = fn(*args)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2
        )
    for gen in TPU:
        sharding = jax.sharding.SingleDeviceSharding(topology_device(gen))
        for case in shapes[1:]:
            avals = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in case]
            jax.jit(kernel).trace(*avals).lower().compile()


def test_a_per_pixel_value_needed_outside_keeps_the_row_wise_kernel() -> None:
    """The per-pixel max is also a program output: the conv kernel stores only full blocks, so the channel
    reduction stays out of it (the author falls back to the unfused form) and the result is still right."""

    def softmax_and_max(x, w):
        y = lax.conv_general_dilated(
            x,
            w,
            (1, 1),
            "SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            preferred_element_type=jnp.float32,
        )
        return jax.nn.softmax(y, axis=-1), jnp.max(y, axis=-1)

    shapes = [((2, 16, 16, 64), (3, 3, 64, 128)), ((1, 5, 7, 3), (3, 3, 3, 5))]
    configs = [Config(dynamic=[(s, "float32") for s in case], static=[]) for case in shapes]
    program = lower_program(trace_reference(softmax_and_max, configs, ["x", "w"], direct_conv=True), "t")
    src = render(program, default_config(program, TPU), TPU)
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    args = [jnp.asarray(np.random.default_rng(2).standard_normal(s), jnp.float32) for s in shapes[1]]
    with pltpu.force_tpu_interpret_mode():
        got = ns["computation"](*args)
    for g, w in zip(got, softmax_and_max(*args), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4, rtol=1e-4)
