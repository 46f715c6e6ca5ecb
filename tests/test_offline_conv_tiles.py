"""Default tiles of the direct conv kernel: the output-channel block is the N of every tap's MXU matmul, so
it fills the widest target MXU (256 on v6e) when the conv has that many channels; the row block shrinks
instead (to a divisor of the rows, so nothing is padded). Correct in TPU interpret mode at that block on an
aligned and an odd shape, and compiles for v5e and v6e ahead of time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from offline_helpers import (
    TPU,
    check_interpreted,
    check_on_normal_inputs,
    compiles_at,
    conv_program,
    load_module,
)

from maxkernel.authors.offline.conv_kernel import MXU_DEPTHS, merged_dims, padded_depth
from maxkernel.authors.offline.spec import block_for
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.estimate import estimate_pallas


def conv_relu_f32(x, w):
    y = lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=lax.Precision.HIGHEST
    )
    return jax.nn.relu(y)


# the task-size shape first (it sets the extents the tiles are chosen for), then small aligned / odd ones
SHAPES = [
    ((8, 56, 56, 256), (3, 3, 256, 256)),
    ((1, 8, 8, 256), (3, 3, 256, 256)),
    ((1, 7, 9, 5), (3, 3, 5, 256)),
]


def _program():
    return conv_program(conv_relu_f32, SHAPES, "float32", ["x", "w"])


def test_channel_block_fills_the_widest_mxu_and_stays_correct() -> None:
    program = _program()
    assert [k.family for k in program.kernels] == ["conv"]
    config = default_config(program, TPU).as_dict()
    block_o = next(v for k, v in config.items() if k.endswith("block_o"))
    block_rows = next(v for k, v in config.items() if k.endswith("block_rows"))
    assert block_o == 256  # not 128: v6e's 256-wide MXU would run at half rate
    assert 56 % block_for(56, block_rows, 1) == 0  # the run-time row block divides the rows: no padding
    _, kernel = load_module(program)
    # the block model on v6e: no N padding of the tap matmuls
    (call,) = estimate_pallas(
        jax.make_jaxpr(kernel)(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in SHAPES[0])), "v6e"
    ).pallas_calls
    assert call.est_mxu_padded_flops == call.est_mxu_flops
    rng = np.random.default_rng(3)
    for xs, ws in SHAPES[1:]:
        x = jnp.asarray(rng.standard_normal(xs), jnp.float32)
        w = jnp.asarray(0.2 * rng.standard_normal(ws), jnp.float32)
        check_interpreted(conv_relu_f32, kernel, (x, w), atol=1e-4, rtol=1e-4)
    compiles_at(kernel, SHAPES[1:2], jnp.float32)


def conv_bias_f32(x, w, b):
    y = lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=lax.Precision.HIGHEST
    )
    return y + b


def conv3d_f32(x, w, b):
    y = lax.conv_general_dilated(
        x,
        w,
        (1, 1, 1),
        "SAME",
        dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
        precision=lax.Precision.HIGHEST,
    )
    return jax.nn.relu(y + b)


MERGED_CASES = [
    # (fn, shapes per config: task-size first, then an aligned and an odd one; depth of a merged contraction)
    (
        conv_bias_f32,
        [
            ((8, 128, 128, 64), (3, 3, 64, 128), (128,)),
            ((1, 8, 8, 64), (3, 3, 64, 128), (128,)),
            ((1, 7, 9, 3), (3, 3, 3, 6), (6,)),
        ],
        9 * 64,  # all nine taps side by side: 576 pads to 640 / 768, not 3 x 256 / 3 x 256
    ),
    (
        conv3d_f32,
        [
            # 128 output channels: 64 would take two columns per matmul row (test_conv_lane_pack.py)
            ((2, 16, 32, 32, 32), (3, 3, 3, 32, 128), (128,)),
            ((1, 4, 8, 8, 32), (3, 3, 3, 32, 128), (128,)),
            ((1, 3, 5, 7, 5), (3, 3, 3, 5, 3), (3,)),
        ],
        27 * 32,  # all 27 taps of one output plane side by side: 864 pads to 896 / 1024
    ),
]


def test_taps_side_by_side_when_channels_do_not_fill_the_mxu() -> None:
    """C_in of 64 (2-D) or 32 (3-D): the taps' windows are concatenated along the channels in VMEM and
    contracted in one matmul of depth taps * C_in, so v6e's 256-deep MXU pads 576 to 768 (or 864 to 1024)
    instead of each 64- (or 32-) deep tap to 256; the block model sees the deeper contraction. C_in of 256
    keeps one matmul per tap."""
    assert "jnp.concatenate" not in _program().kernels[0].code
    rng = np.random.default_rng(5)
    for fn, shapes, depth in MERGED_CASES:
        program = conv_program(fn, shapes, "float32")
        assert program.kernels[0].family == "conv" and "jnp.concatenate" in program.kernels[0].code
        _, kernel = load_module(program)
        big = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes[0]]
        call = estimate_pallas(jax.make_jaxpr(kernel)(*big), "v6e").pallas_calls[0]
        k_pad = -(-depth // 256) * 256
        n_out = shapes[0][1][-1]
        n_pad = -(-n_out // 256) * 256  # the output-channel block pads to the MXU's width too
        assert call.est_mxu_padded_flops == pytest.approx(
            call.est_mxu_flops * (k_pad / depth) * (n_pad / n_out)
        )
        check_on_normal_inputs(fn, kernel, shapes[1:], jnp.float32, rng, scale=0.3, atol=1e-4, rtol=1e-4)
        compiles_at(kernel, shapes[1:2], jnp.float32)


@pytest.mark.parametrize(
    ("c_in", "ksz", "plane_bytes", "merged", "depths"),
    [
        (96, (3, 3), 0, 2, (896, 1024)),  # all taps: 9 x 96 = 864 deep (per-tap 9 x 128 / 9 x 256)
        (128, (3, 3), 0, 2, (1152, 1280)),  # v5e is full at 128 per tap; v6e gains from one 1152-deep matmul
        (256, (3, 3), 0, 0, (2304, 2304)),  # fills both MXUs per tap: nothing to merge
        (320, (3, 3), 0, 1, (3072, 3072)),  # all nine taps: 2944 / 3072, under 5% less: the W taps only
        (32, (3, 3, 3), 64 * 64 * 2, 3, (896, 1024)),  # a 64 x 64 bf16 plane x 864: 7 MiB of VMEM, fits
        (64, (3, 3, 3), 64 * 64 * 4, 2, (1920, 2304)),  # f32: all 27 taps would be 28 MiB; H and W taps only
    ],
)
def test_merge_depth_is_the_least_padding_that_fits(c_in, ksz, plane_bytes, merged, depths) -> None:
    assert merged_dims(c_in, ksz, False, plane_bytes) == merged
    assert tuple(padded_depth(c_in, ksz, merged, d) for d in MXU_DEPTHS) == depths
    assert merged_dims(c_in, ksz, True, plane_bytes) == 0  # depthwise: VPU multiply-adds, no contraction


def conv_bias_bf16(x, w, b):
    y = lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), preferred_element_type=jnp.float32
    )
    return jax.nn.relu(y + b.astype(jnp.float32)).astype(x.dtype)


def test_all_taps_side_by_side_bf16() -> None:
    """A bf16 96-channel 3x3 conv (C_in not a multiple of 128): one 864-deep matmul per row block, correct
    on an aligned and an odd shape in TPU interpret mode, compiled for v5e and v6e, and the block model
    charges 896 / 1024 of depth (the per-tap form: 1152 / 2304)."""
    shapes = [
        ((8, 112, 112, 96), (3, 3, 96, 192), (192,)),
        ((1, 8, 16, 96), (3, 3, 96, 192), (192,)),
        ((2, 7, 9, 5), (3, 3, 5, 6), (6,)),
    ]
    program = conv_program(conv_bias_bf16, shapes, "bfloat16")
    assert "for kh in range(n_kh) for kw in range(n_kw)" in program.kernels[0].code
    _, kernel = load_module(program)
    big = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes[0]]
    for gen, k_pad in (("v5e", 896), ("v6e", 1024)):
        call = estimate_pallas(jax.make_jaxpr(kernel)(*big), gen).pallas_calls[0]
        assert call.est_mxu_padded_flops == pytest.approx(call.est_mxu_flops * (k_pad / 864) * (256 / 192))
    rng = np.random.default_rng(7)
    check_on_normal_inputs(conv_bias_bf16, kernel, shapes[1:], jnp.bfloat16, rng, atol=3e-2, rtol=3e-2)
    compiles_at(kernel, shapes[1:], jnp.bfloat16)


def depthwise_bias_bf16(x, w, b):
    y = lax.conv_general_dilated(
        x,
        w,
        (1, 1),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=x.shape[-1],
        preferred_element_type=jnp.float32,
    )
    return (y + b.astype(jnp.float32)).astype(x.dtype)


def test_depthwise_bf16_converts_its_block_once() -> None:
    """A bf16 depthwise 7x7 conv converts the halo'd block to f32 once per step into VMEM scratch (not each
    of the 49 taps' windows), and pads the output width to f32's 8-row tiles (56 stays 56: no crop copy).
    Correct in TPU interpret mode on an aligned and an odd shape (odd width, 256 channels in two blocks),
    compiled for v5e and v6e."""
    shapes = [
        ((16, 56, 56, 128), (7, 7, 1, 128), (128,)),
        ((1, 8, 16, 128), (7, 7, 1, 128), (128,)),
        ((2, 5, 9, 256), (7, 7, 1, 256), (256,)),
    ]
    program = conv_program(depthwise_bias_bf16, shapes, "bfloat16")
    code = program.kernels[0].code
    assert "xs_ref[...] = x_ref[0].astype(jnp.float32)" in code and "window = xs_ref[" in code
    assert "n_ow_p = _round_up(n_ow, 8)" in code
    _, kernel = load_module(program)
    rng = np.random.default_rng(13)
    check_on_normal_inputs(depthwise_bias_bf16, kernel, shapes[1:], jnp.bfloat16, rng, atol=2e-2, rtol=2e-2)
    compiles_at(kernel, shapes[1:], jnp.bfloat16)
