"""Maps over short trailing axes and layout-only regions (issue 12, the chunked SSD scan's slowest parts).

* An elementwise map whose trailing (rows, lanes) tile is small (80 heads x 64 head dims of a
  [batch, seq, 80, 64] array) blocks the axis ahead of it too, so a grid step moves ~1 MiB instead of one
  40 KiB tile (8192 steps of ~0.35 us each were 2.2 ms of overhead on a 0.46 ms pass over HBM).
* A transpose of a result its producer's kernel cannot take (a scan's stacked outputs) runs as glue, not as
  a kernel that copies the array through VMEM unchanged.

Each: correct in TPU interpret mode on aligned and odd shapes, and an ahead-of-time Mosaic compile for v5e
and v6e. References are the tests' own code (traced in-process)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.base import TileConfig
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.render import render, undefined_names
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.estimate import estimate_pallas
from tests.offline_helpers import check_interpreted, compiles_at

TPU = ["v5e", "v6e"]


def _module(fn, shapes: list[list[tuple[int, ...]]], names: list[str], dtype: str = "float32", **blocks: int):
    configs = [Config(dynamic=[(s, dtype) for s in cfg], static=[]) for cfg in shapes]
    program = lower_program(trace_reference(fn, configs, names), "t")
    config = default_config(program, TPU)
    if blocks:
        config = TileConfig.of({**config.as_dict(), **blocks})
    src = render(program, config, TPU)
    assert undefined_names(src) == []
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    return program, ns["computation"]


def discretise(x, dt, bias):
    """SSD's input scaling: softplus(dt + bias) per (batch, position, head), times x per head dim."""
    d = jax.nn.softplus(dt + bias)
    return x * d[..., None], d


BIG = [(2, 1024, 40, 64), (2, 1024, 40), (40,)]
ODD = [(1, 37, 6, 20), (1, 37, 6), (6,)]


def test_short_trailing_tiles_block_the_leading_axis_too() -> None:
    program, kernel = _module(discretise, [BIG, ODD], ["x", "dt", "bias"])
    assert [k.family for k in program.kernels] == ["elementwise"]
    assert "BLOCK_LEAD" in program.kernels[0].code
    rng = np.random.default_rng(0)
    for shapes in (BIG, ODD):
        check_interpreted(discretise, kernel, [rng.standard_normal(s).astype(np.float32) for s in shapes])
    est = estimate_pallas(jax.make_jaxpr(kernel)(*[jax.ShapeDtypeStruct(s, jnp.float32) for s in BIG]), "v5e")
    (call,) = est.pallas_calls
    # one (40, 64) tile per step would walk all 2 x 1024 positions; slabs of them take a few dozen steps
    assert call.est_grid_steps <= 2 * 1024 // 16, call.est_grid_steps
    compiles_at(kernel, [BIG], jnp.float32)


def stacked_states_read_back(states, decay, c):
    """A scan emits the state entering each step, stacked along the steps; the reader wants it per batch."""

    def step(carry, inp):
        st, d = inp
        return carry * d[:, None, None] + st, carry

    _, prev = lax.scan(step, jnp.zeros(states.shape[1:], jnp.float32), (states, decay))
    prev = prev.transpose(1, 0, 2, 3)  # [batch, steps, p, n]
    return jnp.einsum("bcln,bcpn->bclp", c, prev, precision=lax.Precision.HIGHEST)


@pytest.mark.parametrize(
    "shapes",
    [
        [(4, 2, 64, 128), (4, 2), (2, 4, 16, 128)],
        [(3, 2, 9, 20), (3, 2), (2, 3, 5, 20)],  # odd sizes
    ],
)
def test_a_transpose_between_kernels_is_glue_not_a_copy_kernel(shapes) -> None:
    program, kernel = _module(stacked_states_read_back, [shapes], ["states", "decay", "c"])
    families = [k.family for k in program.kernels]
    # the scan and the matmul only: no elementwise kernel that copies the scan's output unchanged
    assert "elementwise" not in families, families
    assert families.count("scan") == 1, families
    rng = np.random.default_rng(1)
    args = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    args[1] = rng.uniform(0.5, 1.0, shapes[1]).astype(np.float32)
    check_interpreted(stacked_states_read_back, kernel, args, atol=1e-4)
    compiles_at(kernel, [shapes], jnp.float32)


def batch_norm_apply(x, mean, rstd, gamma, beta):
    """A batch norm's normalisation after a conv (NHWC, per-channel statistics), then ReLU."""
    return jax.nn.relu((x - mean) * rstd * gamma + beta)


BN_BIG = [(16, 56, 56, 64), (64,), (64,), (64,), (64,)]
BN_ODD = [(1, 5, 7, 64), (64,), (64,), (64,), (64,)]


def test_narrow_rows_take_larger_row_blocks() -> None:
    """64 channels of bf16 are 128 bytes a row: 256-row blocks moved 32 KiB per step, and the per-step
    overhead cost as much as the pass over HBM. The row block grows to ~1 MiB of input per step."""
    program, kernel = _module(
        batch_norm_apply, [BN_BIG, BN_ODD], ["x", "mean", "rstd", "gamma", "beta"], "bfloat16"
    )
    assert [k.family for k in program.kernels] == ["elementwise"]
    rng = np.random.default_rng(1)
    args = [jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in BN_ODD]
    check_interpreted(batch_norm_apply, kernel, args, atol=6e-2)
    est = estimate_pallas(
        jax.make_jaxpr(kernel)(*[jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in BN_BIG]), "v6e"
    )
    (call,) = est.pallas_calls
    rows = 16 * 56 * 56
    assert call.est_grid_steps <= rows // 1024, call.est_grid_steps  # was rows // 256 = 196 steps
    assert call.est_overhead_seconds < call.est_memory_seconds  # the pass over HBM, not the steps, dominates
    compiles_at(kernel, [BN_BIG], jnp.bfloat16)


def channel_mean(t):
    """A batch norm's mean over (N, H, W) of a 64-channel activation."""
    return jnp.mean(t, axis=(0, 1, 2), keepdims=True)


STATS_SHAPES = [[(32, 56, 56, 64)], [(1, 5, 7, 64)], [(2, 3, 9, 64)]]


def test_streamed_reduction_over_short_lanes_reads_the_input_as_it_lies() -> None:
    """The reduced (N, H, W) rows stay on sublanes and the 64 channels on lanes: putting the long reduced
    axis on the lanes transposed the whole activation in HBM first, a read and a write more than the pass."""
    program, kernel = _module(channel_mean, STATS_SHAPES, ["t"])
    (spec,) = program.kernels
    assert spec.family == "reduction"
    assert "jnp.transpose" not in spec.code
    rng = np.random.default_rng(2)
    for (shape,) in STATS_SHAPES[1:]:
        check_interpreted(channel_mean, kernel, [rng.standard_normal(shape).astype(np.float32)])
    compiles_at(kernel, [STATS_SHAPES[0]], jnp.float32)
