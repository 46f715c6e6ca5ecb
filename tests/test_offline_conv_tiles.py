"""Default tiles of the direct conv kernel: the output-channel block is the N of every tap's MXU matmul, so
it fills the widest target MXU (256 on v6e) when the conv has that many channels; the row block shrinks
instead (to a divisor of the rows, so nothing is padded). Correct in TPU interpret mode at that block on an
aligned and an odd shape, and compiles for v5e and v6e ahead of time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import tpu as pltpu

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.render import render, undefined_names
from maxkernel.authors.offline.spec import block_for
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.estimate import estimate_pallas, topology_device

TPU = ["v5e", "v6e"]


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
    configs = [Config(dynamic=[(x, "float32"), (w, "float32")], static=[]) for x, w in SHAPES]
    return lower_program(trace_reference(conv_relu_f32, configs, ["x", "w"], direct_conv=True), "t")


def test_channel_block_fills_the_widest_mxu_and_stays_correct() -> None:
    program = _program()
    assert [k.family for k in program.kernels] == ["conv"]
    config = default_config(program, TPU).as_dict()
    block_o = next(v for k, v in config.items() if k.endswith("block_o"))
    block_rows = next(v for k, v in config.items() if k.endswith("block_rows"))
    assert block_o == 256  # not 128: v6e's 256-wide MXU would run at half rate
    assert 56 % block_for(56, block_rows, 1) == 0  # the run-time row block divides the rows: no padding
    src = render(program, default_config(program, TPU), TPU)
    assert undefined_names(src) == []
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    kernel = ns["computation"]
    # the block model on v6e: no N padding of the tap matmuls
    (call,) = estimate_pallas(
        jax.make_jaxpr(kernel)(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in SHAPES[0])), "v6e"
    ).pallas_calls
    assert call.est_mxu_padded_flops == call.est_mxu_flops
    rng = np.random.default_rng(3)
    for xs, ws in SHAPES[1:]:
        x = jnp.asarray(rng.standard_normal(xs), jnp.float32)
        w = jnp.asarray(0.2 * rng.standard_normal(ws), jnp.float32)
        with pltpu.force_tpu_interpret_mode():
            got = kernel(x, w)
        np.testing.assert_allclose(np.asarray(got), np.asarray(conv_relu_f32(x, w)), atol=1e-4, rtol=1e-4)
    for gen in TPU:
        sharding = jax.sharding.SingleDeviceSharding(topology_device(gen))
        avals = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding) for s in SHAPES[1]]
        jax.jit(kernel).trace(*avals).lower().compile()
