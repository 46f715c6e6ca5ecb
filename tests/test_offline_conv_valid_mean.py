"""A VALID convolution followed by a global average pool divides by the conv output's area, (H - 2) * (W - 2)
for 3x3 taps. The resolver expresses it from the input's shape, so the direct conv kernel (with the spatial
sum in its epilogue) takes the task instead of the im2col fallback, whose nine shifted copies of the input
went through HBM (3.5 GB on the suite task). Correct in TPU interpret mode on an aligned and an odd shape,
and compiles for v5e and v6e ahead of time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import tpu as pltpu

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.render import render, undefined_names
from maxkernel.authors.offline.trace import Atom, Config, search, trace_reference
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.estimate import topology_device

TPU = ["v5e", "v6e"]


def test_the_area_of_a_valid_window_is_found_last() -> None:
    h = Atom("x.shape[1]", (56.0, 18.0), True)
    c = Atom("x.shape[3]", (256.0, 128.0), True)
    assert search([2916.0, 256.0], False, [h, c]) == "float((x.shape[1] - 2) * (x.shape[1] - 2))"
    assert search([1 / 2916.0, 1 / 256.0], False, [h, c]) == "1.0 / ((x.shape[1] - 2) * (x.shape[1] - 2))"
    assert search([3136.0, 324.0], False, [h, c]) == "x.shape[1] * x.shape[1]"  # simpler forms first


def conv_valid_scale_clamp_mean(x, w):
    y = lax.conv_general_dilated(
        x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"), preferred_element_type=jnp.float32
    )
    return jnp.mean(jnp.clip(y * 0.75, -1.0, 1.0), axis=(1, 2)).astype(x.dtype)


SHAPES = [((2, 18, 18, 128), (3, 3, 128, 128)), ((1, 11, 11, 5), (3, 3, 5, 6))]


def test_valid_conv_global_mean_is_a_direct_kernel() -> None:
    configs = [Config(dynamic=[(x, "bfloat16"), (w, "bfloat16")], static=[]) for x, w in SHAPES]
    program = lower_program(
        trace_reference(conv_valid_scale_clamp_mean, configs, ["x", "w"], direct_conv=True), "t"
    )
    assert program.kernels[0].family == "conv" and "arbitrary" in program.kernels[0].code  # spatial sum fused
    src = render(program, default_config(program, TPU), TPU)
    assert undefined_names(src) == [] and "(x.shape[1] - 2) * (x.shape[1] - 2)" in src
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    kernel = ns["computation"]
    rng = np.random.default_rng(11)
    for xs, ws in SHAPES:
        x = jnp.asarray(rng.standard_normal(xs) + 0.2, jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal(ws) / (9 * xs[-1]) ** 0.5, jnp.bfloat16)
        with pltpu.force_tpu_interpret_mode():
            got = kernel(x, w)
        want = conv_valid_scale_clamp_mean(x, w)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2
        )
    for gen in TPU:
        sharding = jax.sharding.SingleDeviceSharding(topology_device(gen))
        avals = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in SHAPES[0]]
        jax.jit(kernel).trace(*avals).lower().compile()
