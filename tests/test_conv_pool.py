"""A pool after a 2-D or 3-D convolution runs in the conv kernel (conv_pool): the kernel pools its f32
block in VMEM (row windows by splitting the leading axis, column windows by splitting the sublane axis, a
3-D conv's depth windows across the planes of its block) and writes only the pooled block, where the
conv's whole f32 output used to go through HBM into a row-wise kernel.
Correct in TPU interpret mode on aligned and odd shapes (odd channel counts, widths that are not a multiple
of the sublane tile), compiled for v5e and v6e ahead of time; the block model charges the sublane split."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from offline_helpers import check_on_normal_inputs, compiles_at, conv_program, load_module

from maxkernel.authors.offline.conv_epilogue import ConvOut
from maxkernel.authors.offline.conv_pool import pool_split, window_axes
from maxkernel.tools.estimate import estimate_pallas


def conv_hardswish_avgpool(x, w, b):
    f32 = jnp.float32
    y = lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), preferred_element_type=f32
    ) + b.astype(f32)
    y = jax.nn.hard_swish(y)
    n, h, wd, c = y.shape
    return jnp.mean(y.reshape(n, h // 2, 2, wd // 2, 2, c), axis=(2, 4)).astype(x.dtype)


def conv_relu_maxpool_rows(x, w, b):
    """Max over 2-row windows only (the columns kept): a window of 1 along W."""
    f32 = jnp.float32
    y = jax.nn.relu(
        lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), preferred_element_type=f32
        )
        + b.astype(f32)
    )
    n, h, wd, c = y.shape
    return jnp.max(y.reshape(n, h // 2, 2, wd, c), axis=2).astype(x.dtype)


def conv3d_softmax_maxpool(x, w, b):
    f32 = jnp.float32
    y = lax.conv_general_dilated(
        x, w, (1, 1, 1), "SAME", dimension_numbers=("NDHWC", "DHWIO", "NDHWC"), preferred_element_type=f32
    ) + b.astype(f32)
    y = jax.nn.softmax(y, axis=-1)
    n, d, h, wd, c = y.shape
    return jnp.max(y.reshape(n, d // 2, 2, h // 2, 2, wd // 2, 2, c), axis=(2, 4, 6)).astype(x.dtype)


def conv3d_relu_avgpool(x, w, b):
    f32 = jnp.float32
    y = jax.nn.relu(
        lax.conv_general_dilated(
            x, w, (1, 1, 1), "SAME", dimension_numbers=("NDHWC", "DHWIO", "NDHWC"), preferred_element_type=f32
        )
        + b.astype(f32)
    )
    n, d, h, wd, c = y.shape
    return jnp.mean(y.reshape(n, d // 2, 2, h // 2, 2, wd // 2, 2, c), axis=(2, 4, 6)).astype(x.dtype)


CASES = [
    # (fn, shapes per config: task-size first, then an aligned and an odd one)
    (
        conv_hardswish_avgpool,
        [
            ((32, 112, 112, 96), (3, 3, 96, 192), (192,)),
            ((2, 16, 16, 64), (3, 3, 64, 128), (128,)),
            ((1, 6, 10, 5), (3, 3, 5, 3), (3,)),
        ],
    ),
    (
        conv_relu_maxpool_rows,
        [
            ((16, 64, 64, 128), (3, 3, 128, 256), (256,)),
            ((1, 8, 16, 128), (3, 3, 128, 256), (256,)),
            ((2, 10, 7, 5), (3, 3, 5, 7), (7,)),
        ],
    ),
    (  # 3-D: the depth window combined across the planes of a block, after a softmax over the channels
        conv3d_softmax_maxpool,
        [
            ((8, 32, 64, 64, 32), (3, 3, 3, 32, 64), (64,)),
            ((2, 4, 8, 16, 16), (3, 3, 3, 16, 32), (32,)),
            ((1, 6, 4, 10, 5), (3, 3, 3, 5, 3), (3,)),
        ],
    ),
    (
        conv3d_relu_avgpool,
        [
            ((4, 32, 64, 64, 64), (3, 3, 3, 64, 64), (64,)),
            ((1, 4, 8, 16, 32), (3, 3, 3, 32, 64), (64,)),
            ((2, 6, 4, 6, 5), (3, 3, 3, 5, 7), (7,)),
        ],
    ),
]


@pytest.mark.parametrize(
    ("fn", "shapes"), CASES, ids=["avg_2x2", "max_rows", "softmax_max_2x2x2", "avg_2x2x2"]
)
def test_pool_in_the_conv_kernel(fn, shapes) -> None:
    program = conv_program(fn, shapes, "bfloat16")
    assert [k.family for k in program.kernels] == ["conv"]  # no row-wise pool kernel after it
    _, kernel = load_module(program)
    # HBM: the input once (plus halo and weights) and the pooled output, never the full-size conv result
    big = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes[0]]
    (call,) = estimate_pallas(jax.make_jaxpr(kernel)(*big), "v5e").pallas_calls
    x_bytes = np.prod(shapes[0][0]) * 2
    full_out_f32 = (
        np.prod(jax.eval_shape(fn, *big).shape)
        * 4
        * {2: 2, 4: 4, 8: 8}[{conv_hardswish_avgpool: 4, conv_relu_maxpool_rows: 2}.get(fn, 8)]
    )
    assert call.est_hbm_bytes < 1.5 * x_bytes + 0.5 * full_out_f32
    rng = np.random.default_rng(17)
    check_on_normal_inputs(fn, kernel, shapes[1:], jnp.bfloat16, rng, atol=5e-2, rtol=2e-2)
    compiles_at(kernel, shapes[1:], jnp.bfloat16)


def test_pool_split_reads_windows_from_the_reshape() -> None:
    out = ConvOut(shape=(2, 16, 12, 8), channel_dim=3)
    assert pool_split(out, out.shape, (2, 8, 2, 6, 2, 8)) == (2, 2)
    assert pool_split(out, out.shape, (2, 8, 2, 12, 8)) == (2, 1)
    assert pool_split(out, out.shape, (2, 16, 4, 3, 8)) == (1, 3)
    assert window_axes((2, 2)) == (2, 4) and window_axes((2, 1)) == (2,) and window_axes((1, 3)) == (3,)
    assert pool_split(out, out.shape, (2, 16, 12, 2, 4)) is None  # splits the channels: not a pool
    assert pool_split(out, out.shape, (2, 192, 8)) is None  # merges dims
    assert (
        pool_split(ConvOut(shape=(2, 8, 16, 12), channel_dim=1), (2, 8, 16, 12), (2, 8, 8, 2, 6, 2)) is None
    )


def _split_kernel(x_ref, o_ref, *, sublanes: bool):
    v = x_ref[...]  # f32[64, 128]
    if sublanes:
        o_ref[...] = jnp.sum(v.reshape(32, 2, 128), axis=1)  # 2-row windows: a split of the sublane dim
    else:
        o_ref[...] = jnp.sum(v.reshape(2, 32, 128), axis=0)  # halves: a split of whole tiles of rows


@pytest.mark.parametrize("sublanes", [True, False])
def test_block_model_charges_a_sublane_split(sublanes: bool) -> None:
    """A reshape that splits the sublane dim into pieces smaller than a tile moves data between vregs;
    splitting whole tiles of rows does not. Before, every reshape in a kernel was free."""

    def run(x):
        return pl.pallas_call(
            functools.partial(_split_kernel, sublanes=sublanes),
            out_shape=jax.ShapeDtypeStruct((32, 128), jnp.float32),
        )(x)

    jaxpr = jax.make_jaxpr(run)(jax.ShapeDtypeStruct((64, 128), jnp.float32))
    (call,) = estimate_pallas(jaxpr, "v5e").pallas_calls
    if sublanes:  # the (32, 2, 128) split, its 2-row sublane dim padded to a tile: relayout + the sum over it
        assert call.est_vpu_elementwise_ops == 2 * (32 * 8 * 128)
    else:  # only the sum over the (2, 32, 128) value
        assert call.est_vpu_elementwise_ops == 2 * 32 * 128
