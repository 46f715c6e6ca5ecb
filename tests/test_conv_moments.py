"""Batch / instance norm statistics of a convolution come out of the conv kernel's own pass (moments.py):
the conv writes its output and accumulates its spatial (+ batch) sum and sum of squares in the epilogue, so
only the normalisation reads the output back (three passes over it in HBM become one). Each case: correct in
TPU interpret mode on an aligned and an odd shape, with row blocks that accumulate over several steps (and a
padded last block), and compiles for v5e and v6e ahead of time."""

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


def _conv(x, w):
    nsp = x.ndim - 2
    spec = {2: ("NHWC", "HWIO", "NHWC"), 3: ("NDHWC", "DHWIO", "NDHWC")}[nsp]
    return lax.conv_general_dilated(
        x, w, (1,) * nsp, "SAME", dimension_numbers=spec, precision=lax.Precision.HIGHEST
    )


def conv_batchnorm_relu(x, w, g, b):
    """Training-mode batch norm: statistics over (N, H, W), one (C,) pair for the whole batch."""
    y = _conv(x, w)
    mean = jnp.mean(y, axis=(0, 1, 2), keepdims=True)
    var = jnp.mean(jnp.square(y - mean), axis=(0, 1, 2), keepdims=True)
    return jax.nn.relu((y - mean) * lax.rsqrt(var + 1e-5) * g + b)


def conv_instancenorm_leakyrelu(x, w, g, b):
    """Instance norm: statistics per sample over (H, W), an (N, C) pair; the affine inputs unused."""
    del g, b
    y = _conv(x, w)
    mean = jnp.mean(y, axis=(1, 2), keepdims=True)
    var = jnp.mean(jnp.square(y - mean), axis=(1, 2), keepdims=True)
    return jax.nn.leaky_relu((y - mean) * lax.rsqrt(var + 1e-5), 0.2)


def conv3d_batchnorm_hardtanh(x, w, g, b):
    """3-D: the kernel walks output planes; the statistics span (N, D, H, W)."""
    y = _conv(x, w)
    mean = jnp.mean(y, axis=(0, 1, 2, 3), keepdims=True)
    var = jnp.mean(jnp.square(y - mean), axis=(0, 1, 2, 3), keepdims=True)
    return jnp.clip((y - mean) * lax.rsqrt(var + 1e-5) * g + b, -1.0, 1.0)


def conv_bias_groupnorm_silu(x, w, g, b, groups):
    """Group norm, written on a (N, H, W, G, C // G) split: evaluated per channel (the spatial sums in the
    conv kernel, a tiny per-group sum, the normalisation on the unsplit conv output)."""
    y = _conv(x, w) + b
    n, h, wd, c = y.shape
    yg = y.reshape(n, h, wd, groups, c // groups)
    mean = jnp.mean(yg, axis=(1, 2, 4), keepdims=True)
    var = jnp.mean(jnp.square(yg - mean), axis=(1, 2, 4), keepdims=True)
    return jax.nn.silu(((yg - mean) * lax.rsqrt(var + 1e-5)).reshape(n, h, wd, c) * g + b)


def conv_library_instancenorm(x, w, g, b):
    """PyTorch-style: `jnp.mean` and `jnp.var` (a `jit` of its own that recomputes the mean), then an affine."""
    y = _conv(x, w) + b
    mean = jnp.mean(y, axis=(1, 2), keepdims=True)
    var = jnp.var(y, axis=(1, 2), keepdims=True)
    return (y - mean) / jnp.sqrt(var + 1e-5) * g + b


def conv_nchw_groupnorm_tanh(x, w, g, b, groups):
    """PyTorch layout: NCHW data around an NHWC conv, the group norm split on the channel dim of the NCHW
    value, (N, G, C // G, H, W)."""
    y = jnp.transpose(_conv(jnp.transpose(x, (0, 2, 3, 1)), w), (0, 3, 1, 2))
    n, c, h, wd = y.shape
    yg = y.reshape(n, groups, c // groups, h, wd)
    mean = jnp.mean(yg, axis=(2, 3, 4), keepdims=True)
    var = jnp.var(yg, axis=(2, 3, 4), keepdims=True)
    y = ((yg - mean) / jnp.sqrt(var + 1e-5)).reshape(n, c, h, wd)
    return jnp.tanh(y * g.reshape(1, -1, 1, 1) + b.reshape(1, -1, 1, 1))


# per case: the task's own shapes (traced only: the size decisions are made there, as for a task), then
# an aligned and an odd validation shape, run in interpret mode
CASES = [
    (
        conv_batchnorm_relu,
        [
            ((4, 128, 136, 16), (3, 3, 16, 128)),
            ((2, 8, 8, 16), (3, 3, 16, 128)),
            ((3, 7, 9, 3), (3, 3, 3, 5)),
        ],
    ),
    (  # per sample: (N, C) statistics, one image longer than a row-wise kernel holds whole
        conv_instancenorm_leakyrelu,
        [
            ((2, 264, 256, 16), (3, 3, 16, 128)),
            ((2, 8, 8, 16), (3, 3, 16, 128)),
            ((3, 7, 9, 3), (3, 3, 3, 5)),
        ],
    ),
    (
        conv3d_batchnorm_hardtanh,
        [
            ((2, 16, 64, 64, 8), (3, 3, 3, 8, 128)),
            ((1, 4, 8, 8, 8), (3, 3, 3, 8, 128)),
            ((2, 3, 5, 7, 3), (3, 3, 3, 3, 6)),
        ],
    ),
    (  # the library's variance is seen through its `jit`, and its repeat of the mean is the caller's
        conv_library_instancenorm,
        [
            ((2, 264, 256, 16), (3, 3, 16, 128)),
            ((2, 8, 8, 16), (3, 3, 16, 128)),
            ((3, 7, 9, 3), (3, 3, 3, 5)),
        ],
    ),
    (  # x is NCHW here
        conv_nchw_groupnorm_tanh,
        [((2, 16, 16, 16), (3, 3, 16, 128)), ((2, 16, 8, 8), (3, 3, 16, 128)), ((3, 3, 7, 9), (3, 3, 3, 12))],
    ),
    (
        conv_bias_groupnorm_silu,
        [((2, 16, 16, 16), (3, 3, 16, 128)), ((2, 8, 8, 16), (3, 3, 16, 128)), ((3, 7, 9, 3), (3, 3, 3, 12))],
    ),
]
STATIC = {"conv_bias_groupnorm_silu": [4], "conv_nchw_groupnorm_tanh": [4]}


def _program(fn, shapes):
    static = STATIC.get(fn.__name__, [])
    configs = [
        Config(
            dynamic=[(x, "float32"), (w, "float32"), ((w[-1],), "float32"), ((w[-1],), "float32")],
            static=static,
        )
        for x, w in shapes
    ]
    names = ["x", "w", "g", "b", *(["groups"] if static else [])]
    return lower_program(trace_reference(fn, configs, names, direct_conv=True), "t", options=FUSION_LEVELS[0])


@pytest.mark.parametrize(("fn", "shapes"), CASES, ids=[c[0].__name__ for c in CASES])
def test_norm_statistics_come_from_the_conv_pass(fn, shapes) -> None:
    program = _program(fn, shapes)
    conv = program.kernels[0]
    static = STATIC.get(fn.__name__, [])
    assert conv.family == "conv"
    # the conv kernel writes its output and both sums; the last kernel normalises; none reads the conv
    # output for its statistics (a group norm sums each group's channels in two tiny row-wise kernels)
    assert program.kernels[-1].family == "elementwise"
    assert all(k.family == "rowwise" for k in program.kernels[1:-1]) and len(program.kernels) <= 4
    assert "arbitrary" in conv.code and conv.code.count("jnp.sum(part, axis=0, keepdims=True)") == 2
    default = default_config(program, TPU)
    rng = np.random.default_rng(3)
    for config in [default, default.replace(block_rows=2)]:
        src = render(program, config, TPU)
        assert undefined_names(src) == []
        ns: dict = {}
        exec(compile(src, "generated", "exec"), ns)
        kernel = ns["computation"]
        for xs, ws in shapes[1:]:
            args = (
                jnp.asarray(rng.standard_normal(xs) + 0.5, jnp.float32),  # a mean away from zero
                jnp.asarray(0.3 * rng.standard_normal(ws), jnp.float32),
                jnp.asarray(1.0 + 0.2 * rng.standard_normal(ws[-1]), jnp.float32),
                jnp.asarray(0.2 * rng.standard_normal(ws[-1]), jnp.float32),
            )
            with pltpu.force_tpu_interpret_mode():
                got = kernel(*args, *static)
            want = fn(*args, *static)
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)
    for gen in TPU:
        sharding = jax.sharding.SingleDeviceSharding(topology_device(gen))
        xs, ws = shapes[1]
        avals = [
            jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding) for s in (xs, ws, (ws[-1],), (ws[-1],))
        ]
        jax.jit(lambda *a: kernel(*a, *static)).trace(*avals).lower().compile()


def test_instance_norm_of_a_small_image_keeps_its_row_wise_kernel() -> None:
    """An instance norm whose (H * W) rows a row-wise kernel holds whole reads the conv output once there
    (statistics and normalisation in one kernel): the one-pass form would add a pass, and is not used."""
    program = _program(conv_instancenorm_leakyrelu, CASES[1][1][1:])
    assert [k.family for k in program.kernels] == ["conv", "rowwise"]
    assert "acc * acc" not in program.kernels[0].code  # no sum of squares: the variance stays two-pass


def test_two_pass_variance_stays_where_the_row_is_whole() -> None:
    """Without a conv (a plain map over rows held whole in VMEM) the reference's two-pass variance is kept."""

    def layer_norm(x, w, g, b):
        del w
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        return (x - mean) * lax.rsqrt(var + 1e-5) * g + b

    configs = [
        Config(
            dynamic=[((16, 128), "float32"), ((1,), "float32"), ((128,), "float32"), ((128,), "float32")],
            static=[],
        )
    ]
    traced = trace_reference(layer_norm, configs, ["x", "w", "g", "b"], direct_conv=True)
    names = [e.primitive.name for e in traced.primary.jaxpr.eqns]
    # (x - mean), the variance's and the output's, is computed once (repeats merged) and squared: two-pass
    assert "square" in names and names.count("sub") == 1


def test_sum_of_squares_matches_the_centred_form_of_a_conv() -> None:
    """The traced program (before any kernel) computes the same variance as the reference's two passes."""
    shapes = [((2, 200, 200, 4), (3, 3, 4, 8)), ((2, 6, 5, 4), (3, 3, 4, 8))]
    configs = [
        Config(dynamic=[(x, "float32"), (w, "float32"), ((8,), "float32"), ((8,), "float32")], static=[])
        for x, w in shapes
    ]
    traced = trace_reference(conv_batchnorm_relu, configs, ["x", "w", "g", "b"], direct_conv=True)
    names = [e.primitive.name for e in traced.primary.jaxpr.eqns]
    assert names.count("sub") == 2 and names.count("reduce_sum") == 2  # y - mean only for the output now
    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.standard_normal(s) + 2.0, jnp.float32) for s in [*shapes[1], (8,), (8,)]]
    small = traced.others[0]
    got = jax.core.eval_jaxpr(small.jaxpr, small.consts, *args)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(conv_batchnorm_relu(*args)), atol=1e-4, rtol=1e-4)


def _bf16_program(fn, shapes, static=()):
    """The offline author's program for a bf16 conv reference (x, w, g, b[, static]) at these shapes."""
    configs = [
        Config(
            dynamic=[(x, "bfloat16"), (w, "bfloat16"), ((w[-1],), "bfloat16"), ((w[-1],), "bfloat16")],
            static=list(static),
        )
        for x, w in shapes
    ]
    names = ["x", "w", "g", "b", *(["groups"] if static else [])]
    return lower_program(trace_reference(fn, configs, names, direct_conv=True), "t", options=FUSION_LEVELS[0])


def _bf16_runs(src, shapes, seed, static=()):
    """(args, the rendered kernel's outputs in TPU interpret mode) at each validation shape (`shapes[1:]`):
    a mean away from zero, small weights, an affine near identity."""
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    rng = np.random.default_rng(seed)
    for xs, ws in shapes[1:]:
        args = (
            jnp.asarray(rng.standard_normal(xs) + 0.5, jnp.bfloat16),
            jnp.asarray(0.3 * rng.standard_normal(ws), jnp.bfloat16),
            jnp.asarray(1.0 + 0.2 * rng.standard_normal(ws[-1]), jnp.bfloat16),
            jnp.asarray(0.2 * rng.standard_normal(ws[-1]), jnp.bfloat16),
        )
        with pltpu.force_tpu_interpret_mode():
            got = ns["computation"](*args, *static)
        yield args, got


def test_bf16_group_norm_is_evaluated_per_channel() -> None:
    """The bf16 program of a PyTorch-layout group norm (`jnp.mean` / `jnp.var` sum a float32 cast of the split
    value; the normalisation is bf16 arithmetic with the mean rounded to bf16) takes the same per-channel
    form as float32: the statistics from the conv pass, two tiny group sums, one normalising kernel on the
    unsplit conv output (no kernel re-reads the conv output in the (N, G, C // G, H, W) split), and it
    rounds as the reference does."""
    fn, shapes = conv_nchw_groupnorm_tanh, CASES[4][1]
    program = _bf16_program(fn, shapes, static=[4])
    assert [k.family for k in program.kernels] == ["conv", "rowwise", "rowwise", "elementwise"]
    src = render(program, default_config(program, TPU), TPU)
    for args, got in _bf16_runs(src, shapes, 5, static=[4]):
        want = fn(*args, 4)
        assert got.dtype == want.dtype == jnp.bfloat16
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2
        )


def conv_nchw_instancenorm_divide(x, w, g, b):
    """bf16, PyTorch layout: the statistics of `jnp.mean` / `jnp.var` read a float32 cast of the conv output,
    the normalisation reads the bf16 output itself."""
    y = jnp.transpose(_conv(jnp.transpose(x, (0, 2, 3, 1)), w), (0, 3, 1, 2))
    mean = jnp.mean(y, axis=(2, 3), keepdims=True)
    var = jnp.var(y, axis=(2, 3), keepdims=True)
    y = (y - mean) / jnp.sqrt(var + 1e-5)
    return (y * g.reshape(1, -1, 1, 1) + b.reshape(1, -1, 1, 1)) / 2.0


def test_a_widening_cast_is_computed_by_its_reader() -> None:
    """The conv kernel writes its bf16 output once; the norm kernel casts its own blocks to float32. With
    the cast left in the conv kernel, the conv wrote an f32 copy beside the bf16 output (twice its bytes)
    and the norm kernel read both."""
    import re

    shapes = [
        ((2, 16, 64, 64), (3, 3, 16, 128)),
        ((2, 16, 16, 16), (3, 3, 16, 128)),
        ((1, 8, 9, 11), (3, 3, 8, 16)),
    ]
    fn = conv_nchw_instancenorm_divide
    program = _bf16_program(fn, shapes)
    assert [k.family for k in program.kernels] == ["conv", "rowwise"]
    src = render(program, default_config(program, TPU), TPU)
    (conv_call,) = [ln for ln in src.split("def computation", 1)[1].splitlines() if "= _conv_0(" in ln]
    assert not re.search(r"f32\[\d+, \d+, \d+, \d+\]", conv_call), conv_call  # no full-size f32 output
    for args, got in _bf16_runs(src, shapes, 7):
        want = fn(*args)
        assert got.dtype == want.dtype == jnp.bfloat16
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2
        )


def conv_nchw_mish_batchnorm(x, w, g, b):
    """bf16, PyTorch layout, training-mode batch norm written out: the mean rounded to bf16, `x - mean` and
    its square in bf16, summed as a float32 cast."""
    y = jnp.transpose(_conv(jnp.transpose(x, (0, 2, 3, 1)), w), (0, 3, 1, 2))
    y = y * jnp.tanh(jax.nn.softplus(y))
    mean = jnp.mean(y, axis=(0, 2, 3), keepdims=True)
    var = jnp.mean((y - mean) ** 2, axis=(0, 2, 3), keepdims=True)
    y = (y - mean) / jnp.sqrt(var + 1e-5)
    return y * g.reshape(1, -1, 1, 1) + b.reshape(1, -1, 1, 1)


def test_bf16_batch_norm_statistics_come_from_the_conv_pass() -> None:
    """The bf16 batch norm's sum of squares is taken in the conv kernel's epilogue, in float32, from the
    bf16-rounded mean (sum(y^2) - 2 h s + n h^2): the conv output is read once more, to normalise it."""
    shapes = [
        ((8, 16, 128, 128), (3, 3, 16, 128)),
        ((2, 16, 16, 16), (3, 3, 16, 128)),
        ((1, 8, 9, 11), (3, 3, 8, 16)),
    ]
    fn = conv_nchw_mish_batchnorm
    program = _bf16_program(fn, shapes)
    assert [k.family for k in program.kernels] == ["conv", "elementwise"]
    src = render(program, default_config(program, TPU), TPU)
    for args, out in _bf16_runs(src, shapes, 11):
        got = np.asarray(out, np.float32)
        want = np.asarray(fn(*args), np.float32)
        exact = np.asarray(fn(*[a.astype(jnp.float32) for a in args]), np.float32)
        # as close to exact arithmetic as the bf16 reference is, give or take one bf16 rounding
        assert np.max(np.abs(got - exact)) <= np.max(np.abs(want - exact)) + 2e-2 * np.max(np.abs(exact))
