"""Lane packing in the direct conv kernel (conv_kernel.lane_pack): a conv with few output channels computes
`pack` adjacent output columns per matmul row (the input reshaped to column groups, the weights made
block-banded), so its matmuls fill more of the MXU's width. Each case: the packing is chosen (or refused) as
the MXU arithmetic says, the kernel is correct in TPU interpret mode on odd shapes (widths that do not divide
the packing, padded last row blocks, spatial and batch reductions whose padded lanes must be masked), and it
compiles for v5e and v6e ahead of time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from offline_helpers import TPU, check_on_normal_inputs, compiles_at, conv_program, load_module

from maxkernel.authors.offline.conv_kernel import lane_pack, packed_taps
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.checks import check_pallas_does_work
from maxkernel.tools.estimate import estimate_pallas


def test_narrow_output_channels_are_packed_only_where_no_mxu_loses() -> None:
    # 64 channels: 2 columns per row (128 lanes) is 1.7x less padded MXU work on v5e and 2x on v6e
    assert lane_pack(64, 64, (3, 3), False)[0] == 2
    assert lane_pack(64, 64, (3, 3, 3), False, plane_bytes=64 * 64 * 4)[0] == 2
    assert lane_pack(3, 32, (3, 3), False)[0] == 4  # 32 channels: four columns fill a 128-wide row
    # 128 channels packed to 256 would help v6e but cost v5e more depth padding: left alone
    assert lane_pack(64, 128, (3, 3), False)[0] == 1
    assert lane_pack(256, 256, (3, 3), False)[0] == 1
    assert lane_pack(64, 64, (3, 3), True)[0] == 1  # depthwise: VPU work, no MXU width to fill
    assert lane_pack(64, 64, (3, 3), False, choices=(1,))[0] == 1  # a pool over W allows only its window
    assert lane_pack(32, 32, (3, 3), False, choices=(1, 2))[0] == 2
    # two adjacent outputs of a 3-wide filter read 4 input columns: 2 groups of 2; a 1-wide filter 1 group
    assert (
        packed_taps((3, 3), 2) == (3, 2)
        and packed_taps((3, 1), 4) == (3, 1)
        and packed_taps((1, 7), 4) == (1, 3)
    )


def conv_bias_relu(x, w, b):
    """SAME padding, a per-channel bias (tiled once per packed column) and a ReLU."""
    y = lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=lax.Precision.HIGHEST
    )
    return jax.nn.relu(y + b)


def conv_valid_scale_nchw(x, w, b):
    """VALID padding, channels first (transposed around the kernel), a scale: the packed output columns
    must land back in their own places after the layout change."""
    y = lax.conv_general_dilated(
        x, w, (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW"), precision=lax.Precision.HIGHEST
    )
    return y * b[None, :, None, None]


def conv_bias_sigmoid_spatialsum_bf16(x, w, b):
    """bf16 (16-row sublane tiles: the packed width is a multiple of 32), a spatial sum whose padded columns
    sit in the upper lanes of a packed row (sigmoid of the padding is 0.5, not 0: they must be masked)."""
    y = lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), preferred_element_type=jnp.float32
    )
    return jnp.sum(jax.nn.sigmoid(y + b.astype(jnp.float32)), axis=(1, 2))


def conv3d_batch_moments(x, w, b):
    """3-D with training-mode batch-norm statistics: (C,) sums over batch and space accumulated in the kernel
    (per packed column, combined after it) next to the full-size output."""
    del b
    y = lax.conv_general_dilated(
        x,
        w,
        (1, 1, 1),
        "SAME",
        dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
        precision=lax.Precision.HIGHEST,
    )
    mean = jnp.mean(y, axis=(0, 1, 2, 3), keepdims=True)
    var = jnp.mean(jnp.square(y - mean), axis=(0, 1, 2, 3), keepdims=True)
    return jnp.clip((y - mean) * lax.rsqrt(var + 1e-5), -1.0, 1.0)


def conv_softmax(x, w, b):
    """A softmax over the channels: each packed column's max and sum over its own lane group."""
    y = lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=lax.Precision.HIGHEST
    )
    return jax.nn.softmax(y + b, axis=-1)


def conv3d_bias_softmax_maxpool_bf16(x, w, b):
    """The suite's task: 3-D, bf16 in/out, softmax over the channels, a 2x2x2 max pool whose W window is the
    packing (a max across a row's two lane groups)."""
    y = lax.conv_general_dilated(
        x,
        w,
        (1, 1, 1),
        "SAME",
        dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
        preferred_element_type=jnp.float32,
    ) + b.astype(jnp.float32)
    y = jax.nn.softmax(y, axis=-1)
    n, d, h, wd, c = y.shape
    return jnp.max(y.reshape(n, d // 2, 2, h // 2, 2, wd // 2, 2, c), axis=(2, 4, 6)).astype(x.dtype)


def conv_bias_hardswish_avgpool(x, w, b):
    """2-D: a 2x2 average pool on packed rows (the W window sums a row's two lane groups)."""
    y = lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=lax.Precision.HIGHEST
    )
    y = jax.nn.hard_swish(y + b)
    n, h, wd, c = y.shape
    return jnp.mean(y.reshape(n, h // 2, 2, wd // 2, 2, c), axis=(2, 4))


# per case: the shapes the packing is decided at (traced only, like a task's own), then odd validation
# shapes run in interpret mode; the pack the first shapes must get; dtype; tolerance
CASES = [
    (
        conv_bias_relu,
        [((2, 40, 64, 64), (3, 3, 64, 64), (64,)), ((2, 7, 13, 8), (3, 3, 8, 64), (64,))],
        2,
        "float32",
        1e-4,
    ),
    (
        conv_valid_scale_nchw,
        [((2, 64, 40, 64), (64, 64, 3, 3), (64,)), ((1, 5, 9, 11), (32, 5, 3, 3), (32,))],
        2,
        "float32",
        1e-4,
    ),
    (
        conv_bias_sigmoid_spatialsum_bf16,
        [((2, 32, 64, 64), (3, 3, 64, 64), (64,)), ((2, 9, 21, 16), (3, 3, 16, 64), (64,))],
        2,
        "bfloat16",
        1e-2,
    ),
    (
        conv_softmax,
        [((2, 32, 64, 64), (3, 3, 64, 64), (64,)), ((2, 5, 11, 8), (3, 3, 8, 64), (64,))],
        2,
        "float32",
        1e-5,
    ),
    (
        conv_bias_hardswish_avgpool,
        [((2, 32, 64, 64), (3, 3, 64, 64), (64,)), ((2, 6, 10, 8), (3, 3, 8, 64), (64,))],
        2,
        "float32",
        1e-4,
    ),
    (
        conv3d_bias_softmax_maxpool_bf16,
        [((2, 8, 32, 64, 32), (3, 3, 3, 32, 64), (64,)), ((2, 4, 6, 10, 8), (3, 3, 3, 8, 64), (64,))],
        2,
        "bfloat16",
        2e-2,
    ),
    (
        conv3d_batch_moments,
        [((2, 8, 16, 32, 64), (3, 3, 3, 64, 64), (64,)), ((2, 5, 6, 11, 8), (3, 3, 3, 8, 64), (64,))],
        2,
        "float32",
        1e-3,
    ),
]


@pytest.mark.parametrize(("fn", "shapes", "pack", "dtype", "tol"), CASES, ids=[c[0].__name__ for c in CASES])
def test_packed_conv_is_correct_on_odd_shapes_and_compiles(fn, shapes, pack, dtype, tol) -> None:
    program = conv_program(fn, shapes, dtype)
    conv = program.kernels[0]
    assert conv.family == "conv" and f"pack = {pack} " in conv.code and "lane_packed_weights" in conv.code
    default = default_config(program, TPU)
    # also 2-row blocks: row steps accumulate the reductions and the last block is padded
    for config in (default, default.replace(**{conv.params[0].name.lower(): 2})):
        _, kernel = load_module(program, config)
        check_on_normal_inputs(fn, kernel, shapes[1:], dtype, np.random.default_rng(5), atol=tol, rtol=tol)
    compiles_at(kernel, shapes[1:], jnp.dtype(dtype))
    # the packing outside the kernel (reshapes, the banded weights, the folds) is what the harness allows there
    big = [jax.ShapeDtypeStruct(s, jnp.dtype(dtype)) for s in shapes[0]]
    check, _ = check_pallas_does_work(jax.make_jaxpr(kernel)(*big))
    assert check.ok, check.reason


def test_block_model_sees_the_packed_matmul() -> None:
    """64 -> 64 channels, 3x3: two columns per row make each W-tap group's matmul 2 x 128 = 256 deep and 128
    wide. v5e's 128 x 128 MXU then runs without padding, v6e's 256-wide one pads N 128 -> 256 (2x); unpacked,
    v6e padded N 64 -> 256 and the 576-deep contraction to 768 (5.3x)."""
    fn, shapes = CASES[0][0], CASES[0][1]
    program = conv_program(fn, shapes, "float32")
    _, kernel = load_module(program)
    big = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes[0]]
    for gen, ratio in (("v5e", 1.0), ("v6e", 2.0)):
        call = estimate_pallas(jax.make_jaxpr(kernel)(*big), gen).pallas_calls[0]
        assert call.est_mxu_padded_flops == pytest.approx(ratio * call.est_mxu_flops)
        # the banded weights' zero blocks: 2 groups of 2 columns per row of taps for 3 taps -> 4/3 the flops
        useful = 2.0 * 2 * 40 * 64 * 9 * 64 * 64
        assert call.est_mxu_flops == pytest.approx(useful * 4 / 3)
