"""The direct conv kernel runs its elementwise epilogue (bias, scale, clamp, activation, cast) on the f32
accumulator: one kernel, the conv result never goes to HBM. Each case: correct in TPU interpret mode on an
aligned and an odd shape, and compiles for v5e and v6e ahead of time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import tpu as pltpu

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.partition import FUSION_LEVELS
from maxkernel.authors.offline.render import render, undefined_names
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.estimate import topology_device

TPU = ["v5e", "v6e"]


def conv_bias_hardswish_bf16(x, w, b):
    """bf16 in/out, f32 math: conv + bias + hard-swish + cast (the suite's avg-pool task minus the pool)."""
    y = lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), preferred_element_type=jnp.float32
    ) + b.astype(jnp.float32)
    return jax.nn.hard_swish(y).astype(x.dtype)


def conv_scale_clamp_f32(x, w, s):
    """f32 at HIGHEST, VALID padding, a per-channel scale and a clamp; the raw conv output is also returned
    (two outputs of one kernel)."""
    y = lax.conv_general_dilated(
        x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=lax.Precision.HIGHEST
    )
    return y, jnp.clip(y * s * 0.5, -1.0, 1.0)


def conv3d_bias_sigmoid_nchw(x, w, b):
    """3-D, channels-first: the per-channel bias broadcasts along dim 1, not the last one."""
    y = lax.conv_general_dilated(x, w, (1, 1, 1), "SAME", dimension_numbers=("NCDHW", "OIDHW", "NCDHW"))
    return jax.nn.sigmoid(y + b[None, :, None, None, None])


def conv_bias_sigmoid_spatialsum(x, w, b):
    """The suite's spatial-sum task: the kernel accumulates (N, C_out) over its row steps, padded rows and
    columns masked (sigmoid of the zero padding's conv is 0.5 + bias, not 0)."""
    y = lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=lax.Precision.HIGHEST
    )
    return jnp.sum(jax.nn.sigmoid(y + b), axis=(1, 2))


def conv3d_relu_globalmax_nchw(x, w, b):
    """3-D channels-first, a max over (D, H, W), then a mean-like scale outside the kernel."""
    y = lax.conv_general_dilated(x, w, (1, 1, 1), "SAME", dimension_numbers=("NCDHW", "OIDHW", "NCDHW"))
    return jnp.max(jax.nn.relu(y * b[None, :, None, None, None]), axis=(2, 3, 4)) * 0.5


def depthwise7_bias_bf16(x, w, b):
    """ConvNeXt's 7x7 depthwise conv + bias: one filter per channel, a VPU kernel (no im2col, no MXU)."""
    c = x.shape[-1]
    y = lax.conv_general_dilated(
        x,
        w,
        (1, 1),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=c,
        preferred_element_type=jnp.float32,
    )
    return (y + b.astype(jnp.float32)).astype(x.dtype)


def torch_layout_conv_relu_bias(x, w, b):
    """PyTorch-layout code (JAXBench's): NCHW -> NHWC, the conv, a bias and ReLU, back to NCHW, then a
    (C, 1, 1) bias. The transpose is a view of the kernel's block: the (C, 1, 1) bias joins the epilogue."""
    y = lax.conv_general_dilated(
        jnp.transpose(x, (0, 2, 3, 1)),
        jnp.transpose(w, (2, 3, 1, 0)),
        (1, 1),
        "VALID",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        precision=lax.Precision.HIGHEST,
    )
    y = jnp.transpose(jax.nn.relu(y + b.reshape(1, 1, 1, -1)), (0, 3, 1, 2))
    return y + b.reshape(-1, 1, 1) * 0.5


def torch_layout_conv_spatial_mean(x, w, b):
    """The same, with a mean over (H, W) of the NCHW view: a spatial reduction named in the view's dims."""
    y = lax.conv_general_dilated(
        jnp.transpose(x, (0, 2, 3, 1)),
        jnp.transpose(w, (2, 3, 1, 0)),
        (1, 1),
        "VALID",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        precision=lax.Precision.HIGHEST,
    )
    y = jnp.transpose(jax.nn.gelu(y + b.reshape(1, 1, 1, -1)), (0, 3, 1, 2))
    return jnp.mean(y * b.reshape(1, -1, 1, 1), axis=(2, 3))


CASES = [
    (
        torch_layout_conv_relu_bias,
        [((2, 16, 12, 20), (32, 16, 3, 3), (32,)), ((1, 8, 9, 11), (24, 8, 3, 3), (24,))],
        "float32",
        1e-4,
        1,
    ),
    (
        torch_layout_conv_spatial_mean,
        [((2, 16, 12, 20), (32, 16, 3, 3), (32,)), ((1, 8, 9, 11), (24, 8, 3, 3), (24,))],
        "float32",
        1e-4,
        1,
    ),
    (
        conv_bias_hardswish_bf16,
        [((2, 8, 8, 16), (3, 3, 16, 128), (128,)), ((1, 7, 9, 3), (3, 3, 3, 5), (5,))],
        "bfloat16",
        0.05,
        1,
    ),
    (
        conv_scale_clamp_f32,
        [((1, 8, 8, 8), (3, 3, 8, 128), (128,)), ((1, 9, 7, 3), (3, 3, 3, 6), (6,))],
        "float32",
        1e-4,
        2,
    ),
    (
        conv3d_bias_sigmoid_nchw,
        [((1, 8, 4, 6, 8), (16, 8, 3, 3, 3), (16,)), ((1, 3, 3, 5, 7), (5, 3, 3, 3, 3), (5,))],
        "float32",
        1e-4,
        1,
    ),
    (
        conv_bias_sigmoid_spatialsum,
        [((2, 8, 8, 8), (3, 3, 8, 128), (128,)), ((1, 9, 7, 3), (3, 3, 3, 6), (6,))],
        "float32",
        1e-3,
        1,
    ),
    (
        conv3d_relu_globalmax_nchw,
        [((1, 8, 4, 6, 8), (16, 8, 3, 3, 3), (16,)), ((2, 3, 5, 5, 7), (5, 3, 3, 3, 3), (5,))],
        "float32",
        1e-4,
        1,
    ),
    (
        depthwise7_bias_bf16,
        [((1, 12, 10, 256), (7, 7, 1, 256), (256,)), ((2, 9, 7, 5), (7, 7, 1, 5), (5,))],
        "bfloat16",
        0.05,
        1,
    ),
]


def _program(fn, shapes, dtype, level: int = 0):
    configs = [Config(dynamic=[(s, dtype) for s in case], static=[]) for case in shapes]
    return lower_program(
        trace_reference(fn, configs, ["x", "w", "b"], direct_conv=True), "t", options=FUSION_LEVELS[level]
    )


@pytest.mark.parametrize(
    ("fn", "shapes", "dtype", "atol", "n_out"), CASES, ids=[c[0].__name__ for c in CASES]
)
def test_conv_epilogue_is_fused_correct_and_compiles(fn, shapes, dtype, atol, n_out) -> None:
    program = _program(fn, shapes, dtype)
    assert program.kernels[0].family == "conv"
    # no map kernel reads the conv result back (a scale of the (N, C) result may follow in its own kernel)
    assert all(k.family != "conv" for k in program.kernels[1:]) and len(program.kernels) <= 2
    if "spatial" in fn.__name__ or "global" in fn.__name__:
        assert "arbitrary" in program.kernels[0].code and "n_valid_" in program.kernels[0].code
    else:
        assert len(program.kernels) == 1
    default = default_config(program, TPU)
    # reductions: also 2-row blocks, so that row steps accumulate and the last block is padded
    configs = (
        [default, default.replace(block_rows=2)] if "arbitrary" in program.kernels[0].code else [default]
    )
    if "depthwise" in fn.__name__:  # two channel blocks: x's channel block must follow the output's
        configs.append(default.replace(block_o=128, block_rows=4))
    rng = np.random.default_rng(7)
    for config in configs:
        src = render(program, config, TPU)
        assert undefined_names(src) == [] and "fused epilogue" in src
        ns: dict = {}
        exec(compile(src, "generated", "exec"), ns)
        kernel = ns["computation"]
        for xs, ws, bs in shapes:
            args = (
                jnp.asarray(rng.standard_normal(xs), dtype),
                jnp.asarray(0.3 * rng.standard_normal(ws), dtype),
                jnp.asarray(rng.standard_normal(bs), dtype),
            )
            with pltpu.force_tpu_interpret_mode():
                got = kernel(*args)
            want = fn(*args)
            got, want = jax.tree.leaves(got), jax.tree.leaves(want)
            assert len(got) == len(want) == n_out
            for g, w in zip(got, want, strict=True):
                assert g.shape == w.shape and g.dtype == w.dtype
                np.testing.assert_allclose(
                    np.asarray(g, np.float64), np.asarray(w, np.float64), atol=atol, rtol=atol
                )
    for gen in TPU:
        sharding = jax.sharding.SingleDeviceSharding(topology_device(gen))
        avals = [jax.ShapeDtypeStruct(s, jnp.dtype(dtype), sharding=sharding) for s in shapes[0]]
        jax.jit(kernel).trace(*avals).lower().compile()


def test_less_fused_levels_keep_the_epilogue_in_its_own_kernel() -> None:
    fn, shapes, dtype, _, _ = CASES[2]
    families = [k.family for k in _program(fn, shapes, dtype, level=1).kernels]
    assert families[0] == "conv" and len(families) == 2  # the epilogue: a kernel of its own


def test_full_size_operands_and_reductions_stay_out_of_the_conv_kernel() -> None:
    def conv_residual_mean(x, w, b):
        y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.mean(y + x + b, axis=(1, 2))  # x: a full-size operand; the mean: a reduction

    program = _program(conv_residual_mean, [((1, 8, 8, 128), (3, 3, 128, 128), (128,))], "float32")
    assert program.kernels[0].family == "conv" and len(program.kernels) >= 2
    assert "fused epilogue" not in render(program, default_config(program, TPU), TPU).split("def _map")[0]
