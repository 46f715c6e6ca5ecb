"""PyTorch-layout convolutions (NCHW data, transposed to NHWC around the conv, as JAXBench writes them) run
channels-first: the kernel reads the NCHW input and writes NCHW rows, with no transpose, pad or crop
around it. Each case: correct in TPU interpret mode with one row block, with row blocks that divide the
output rows and with a last block that starts early (its shared rows stored once, counted once by a
reduction), and compiles for v5e and v6e ahead of time."""

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


def _nhwc_conv(x, w):
    return lax.conv_general_dilated(
        jnp.transpose(x, (0, 2, 3, 1)),
        jnp.transpose(w, (2, 3, 1, 0)),
        (1, 1),
        "VALID",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        precision=lax.Precision.HIGHEST,
    )


def relu_bias(x, w, b):
    """Conv + bias + ReLU, back to NCHW, then a (C, 1, 1) bias."""
    y = jnp.transpose(jax.nn.relu(_nhwc_conv(x, w) + b.reshape(1, 1, 1, -1)), (0, 3, 1, 2))
    return y + b.reshape(-1, 1, 1) * 0.5


def gelu_global_mean(x, w, b):
    """A mean over (H, W) of the NHWC result: only the (N, C) means leave the kernel."""
    return jnp.mean(jax.nn.gelu(_nhwc_conv(x, w) + b.reshape(1, 1, 1, -1)), axis=(1, 2))


def batch_stats(x, w, b):
    """Mish, then a training-mode batch norm's statistics over (N, H, W) of the NCHW view, and the max."""
    y = jnp.transpose(_nhwc_conv(x, w) + b.reshape(1, 1, 1, -1), (0, 3, 1, 2))
    y = jnp.tanh(jax.nn.softplus(y)) * y
    return jnp.sum(y, axis=(0, 2, 3)), jnp.max(y, axis=(0, 2, 3)), y


def nchw_conv_scale(x, w, b):
    """A conv written NCHW / OIHW directly (no transposes at all)."""
    y = lax.conv_general_dilated(
        x, w, (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW"), precision=lax.Precision.HIGHEST
    )
    return y * b[None, :, None, None]


CASES = [relu_bias, gelu_global_mean, batch_stats, nchw_conv_scale]
# (x, w, b): 10 output rows (one block of 10, blocks of 8 with the last starting early) and 16 (two of 8)
SHAPES = [((2, 16, 12, 128), (32, 16, 3, 3), (32,)), ((1, 8, 18, 256), (24, 8, 3, 3), (24,))]


def _program(fn, shapes, dtype="float32"):
    configs = [Config(dynamic=[(s, dtype) for s in case], static=[]) for case in shapes]
    return lower_program(
        trace_reference(fn, configs, ["x", "w", "b"], direct_conv=True), "t", options=FUSION_LEVELS[0]
    )


@pytest.mark.parametrize("fn", CASES, ids=[f.__name__ for f in CASES])
def test_pytorch_layout_conv_runs_channels_first(fn) -> None:
    program = _program(fn, SHAPES)
    conv = program.kernels[0]
    assert conv.family == "conv" and "channels-first" in conv.title
    assert "jnp.transpose" not in program.computation_code.split("= _conv")[1]  # nothing after the kernel
    default = default_config(program, TPU)
    rows = [k for k, _ in default.params if k.endswith("block_rows") and not k.startswith("k1")]
    rng = np.random.default_rng(3)
    for config in [default, default.replace(**{rows[0]: 8})]:
        src = render(program, config, TPU)
        assert undefined_names(src) == []
        ns: dict = {}
        exec(compile(src, "generated", "exec"), ns)
        for xs, ws, bs in SHAPES:
            args = (
                jnp.asarray(rng.standard_normal(xs), jnp.float32),
                jnp.asarray(0.3 * rng.standard_normal(ws), jnp.float32),
                jnp.asarray(rng.standard_normal(bs), jnp.float32),
            )
            with pltpu.force_tpu_interpret_mode():
                got = jax.tree.leaves(ns["computation"](*args))
            want = jax.tree.leaves(fn(*args))
            for g, w in zip(got, want, strict=True):
                assert g.shape == w.shape and g.dtype == w.dtype
                np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-4, rtol=2e-4)
    for gen in TPU:
        sharding = jax.sharding.SingleDeviceSharding(topology_device(gen))
        avals = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding) for s in SHAPES[0]]
        jax.jit(ns["computation"]).trace(*avals).lower().compile()


def test_bf16_with_few_channels_compiles_channels_first() -> None:
    """8 bf16 channels per tap are half a packed sublane tile: the taps are stacked in f32."""
    shapes = [((2, 8, 12, 128), (16, 8, 3, 3), (16,))]
    program = _program(gelu_global_mean, shapes, "bfloat16")
    assert "channels-first" in program.kernels[0].title
    src = render(program, default_config(program, TPU), TPU)
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    rng = np.random.default_rng(5)
    args = [jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in shapes[0]]
    with pltpu.force_tpu_interpret_mode():
        got = ns["computation"](*args)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(gelu_global_mean(*args), np.float32), atol=0.05, rtol=0.05
    )
    for gen in TPU:
        sharding = jax.sharding.SingleDeviceSharding(topology_device(gen))
        avals = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in shapes[0]]
        jax.jit(ns["computation"]).trace(*avals).lower().compile()


def test_widths_off_the_lane_tile_keep_the_channels_last_kernel() -> None:
    program = _program(relu_bias, [((2, 16, 12, 20), (32, 16, 3, 3), (32,))])
    assert program.kernels[0].family == "conv" and "channels-first" not in program.kernels[0].title


def test_validation_shape_with_cut_channels_gets_zero_channels_padded() -> None:
    """The task's shape has 16 input channels; a validation shape cut to 3 still runs channels-first (zero
    channels padded on in the wrapper, a no-op at the task's shape) and matches the reference."""
    task = ((2, 16, 12, 128), (32, 16, 3, 3), (32,))
    small = ((2, 3, 10, 128), (32, 3, 3, 3), (32,))
    program = _program(relu_bias, [task, small])
    assert "channels-first" in program.kernels[0].title
    src = render(program, default_config(program, TPU), TPU)
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    rng = np.random.default_rng(7)
    args = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in small]
    with pltpu.force_tpu_interpret_mode():
        got = ns["computation"](*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(relu_bias(*args)), atol=2e-4, rtol=2e-4)
    sharding = jax.sharding.SingleDeviceSharding(topology_device("v5e"))
    avals = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding) for s in task]
    hlo = jax.jit(ns["computation"]).trace(*avals).lower().as_text()
    assert " pad(" not in hlo and "stablehlo.pad" not in hlo  # nothing padded at the task's shape
