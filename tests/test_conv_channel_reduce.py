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
from offline_helpers import check_interpreted, check_on_normal_inputs, compiles_at, conv_program, load_module


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
    program = conv_program(fn, shapes, "bfloat16", names)
    assert [k.family for k in program.kernels] == ["conv"]  # no row-wise kernel reading the conv output back
    code = program.kernels[0].code
    assert "axis=-1, keepdims=True" in code and "bo = n_out  # every channel in one block" in code
    _, kernel = load_module(program)
    rng = np.random.default_rng(11)
    check_on_normal_inputs(fn, kernel, shapes[1:], jnp.bfloat16, rng, atol=2e-2, rtol=2e-2)
    compiles_at(kernel, shapes[1:], jnp.bfloat16)


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
    _, kernel = load_module(conv_program(softmax_and_max, shapes, "float32", ["x", "w"]))
    args = [jnp.asarray(np.random.default_rng(2).standard_normal(s), jnp.float32) for s in shapes[1]]
    check_interpreted(softmax_and_max, kernel, args, atol=1e-4, rtol=1e-4)
