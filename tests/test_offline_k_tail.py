"""Matmuls whose K does not divide its block (issue 12: op_matmul_unaligned_f32, K = 5000).

* The last K block overhangs the array edge and the kernel zeroes both operands past it, instead of a
  zero-padded copy of both operands in HBM (624 MB, 0.85 ms on v5e per the block model at that task's
  shapes).
* The tuner's modelled cost charges the MXU for whole blocks, so it no longer takes 2048-deep K blocks
  (6144 deep on the MXU for K = 5000) over 1024-deep ones (5120) for two fewer steps.

Each: correct in TPU interpret mode (which fills what a block reads past the edge with NaN) on aligned and
odd shapes, f32 and bf16, and an ahead-of-time Mosaic compile for v5e and v6e."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.program_tree import same_program, skeleton, to_tree
from tests.offline_helpers import check_interpreted, compiles_at
from tests.test_offline_short_tiles import TPU, _module


def matmul_highest(a, b):
    return jnp.dot(a, b, precision=lax.Precision.HIGHEST)


@pytest.mark.parametrize(
    "shapes",
    [
        [(64, 1000), (1000, 256)],  # K = 1000 in 256-deep blocks: the last one overhangs by 24
        [(37, 700), (700, 130)],  # odd everywhere
        [(64, 1024), (1024, 256)],  # a lane-aligned K that divides its block: no mask
    ],
)
def test_unaligned_k_is_masked_in_kernel_not_padded_in_hbm(shapes) -> None:
    (m, k), (_, n) = shapes
    program, kernel = _module(matmul_highest, [shapes], ["a", "b"], block_k=256)
    assert ("k_lanes" in program.kernels[0].code) == bool(k % 128)
    assert [kk.family for kk in program.kernels] == ["matmul"]
    sds = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    jaxpr = jax.make_jaxpr(kernel)(*sds)
    prims = {e.primitive.name for e in jaxpr.jaxpr.eqns}
    assert "pad" not in prims, prims  # neither operand is copied to a padded array in HBM
    rng = np.random.default_rng(2)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    # TPU interpret mode fills what a block reads past the array edge with NaN: unmasked, it would show
    check_interpreted(matmul_highest, kernel, (a, b), atol=1e-4)
    compiles_at(kernel, [shapes], jnp.float32)


def test_default_blocks_count_the_work_done_on_padding() -> None:
    """The tuner's modelled cost charges the MXU for whole blocks: a 5000-deep K in 2048-deep blocks is
    6144 deep on the MXU, 23% more work than in 1024-deep ones, for 2 fewer steps per output tile."""
    configs = [Config(dynamic=[((4000, 5000), "float32"), ((5000, 10000), "float32")], static=[])]
    program = lower_program(trace_reference(matmul_highest, configs, ["a", "b"]), "t")
    values = default_config(program, TPU).as_dict()
    for name, extent in (("block_m", 4000), ("block_n", 10000), ("block_k", 5000)):
        b = values[name]
        assert -(-extent // b) * b <= 1.05 * extent, (name, b)


def matmul_bf16(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def test_unaligned_k_mask_on_bf16_operands() -> None:
    shapes = [(64, 1000), (1000, 256)]
    program, kernel = _module(matmul_bf16, [shapes], ["a", "b"], dtype="bfloat16", block_k=256)
    assert "k_lanes" in program.kernels[0].code
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.standard_normal(shapes[0]), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(shapes[1]) / 30, jnp.bfloat16)
    with pltpu.force_tpu_interpret_mode():
        got = kernel(a, b)
    want = matmul_bf16(a, b)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2
    )
    compiles_at(kernel, [shapes], jnp.bfloat16)


def test_one_program_whether_or_not_k_divides_its_block() -> None:
    """The mask is decided from every traced shape, not by a run-time `if` on the extents: the harness
    rejects a kernel whose program at the validation shapes (K = 300, one whole block) differs from the
    one at the task's own shapes (K = 5000 in 1024-deep blocks)."""
    big, small = [(256, 5000), (5000, 512)], [(16, 300), (300, 130)]
    _, kernel = _module(matmul_highest, [big, small], ["a", "b"])
    trees = [
        skeleton(to_tree(jax.make_jaxpr(kernel)(*[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes])))
        for shapes in (big, small)
    ]
    assert same_program(trees[0], trees[1], exact=False) is None
