"""A reduction that turns one axis into another of the same length (top_k over experts, then a one-hot back
onto experts) lays both on one lane dim, with the short k axis leading: before, the row-wise kernel kept
the two apart and put k and the reduced experts in the (sublane, lane) tile, so every input row and every
output element filled a vreg of its own (top-k gating: (16, 32, 1, 1) output blocks, 4096 grid steps,
0.14x of XLA per the block model; issue 12). Top-k regions then swap the two again, rows onto the lanes
(`MapBuilder._lane_dense`), with the experts whole on the sublanes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import tpu as pltpu

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.render import render, undefined_names
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.estimate import estimate_pallas, topology_device

TPU = ["v5e", "v6e"]


def topk_gate(logits, top_k):
    """Dense gates of each row's top-k entries (softmax over the kept logits, zeros elsewhere)."""
    vals, idx = lax.top_k(logits, top_k)
    weights = jax.nn.softmax(vals, axis=-1)
    return jnp.sum(jax.nn.one_hot(idx, logits.shape[-1], dtype=jnp.float32) * weights[..., None], axis=1)


def argmax_gate(logits):
    """Switch-style routing: each row's largest entry kept at its place, the rest zeroed."""
    idx = jnp.argmax(logits, axis=-1)
    return jax.nn.one_hot(idx, logits.shape[-1], dtype=jnp.float32) * jnp.max(logits, axis=-1, keepdims=True)


CASES = [
    (topk_gate, [4], (4096, 64), (100, 24)),
    (argmax_gate, [], (4096, 128), (72, 40)),
]


@pytest.mark.parametrize(("fn", "static", "big", "odd"), CASES, ids=["topk", "argmax"])
def test_reduced_axis_shares_the_lane_dim_with_the_one_it_becomes(fn, static, big, odd) -> None:
    configs = [Config(dynamic=[(s, "float32")], static=list(static)) for s in (big, odd)]
    program = lower_program(trace_reference(fn, configs, ["logits", *(["top_k"] if static else [])]), "t")
    src = render(program, default_config(program, TPU), TPU)
    assert undefined_names(src) == []
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    kernel = ns["computation"]
    rng = np.random.default_rng(0)
    for shape in (big, odd):
        x = rng.standard_normal(shape).astype(np.float32)
        with pltpu.force_tpu_interpret_mode():
            got = kernel(x, *static)
        np.testing.assert_allclose(np.asarray(got), np.asarray(fn(x, *static)), atol=1e-6, rtol=1e-6)
    jaxpr = jax.make_jaxpr(lambda x: kernel(x, *static))(jax.ShapeDtypeStruct(big, jnp.float32))
    est = estimate_pallas(jaxpr, "v5e")
    rows, lanes = big
    for call in est.pallas_calls:
        for op in call.operands:
            if fn is topk_gate:  # top-k regions are lane-dense (test_offline_topk_layout): rows on lanes
                assert op.block_shape[-2] == lanes and op.block_shape[-1] % 128 == 0, op
                continue
            # the expert axis whole on the lanes, a block of rows on the sublanes: whole (8, 128) tiles
            assert op.block_shape[-1] == lanes, op
            assert op.block_shape[-2] >= 8, op
    # blocks of many rows: a handful of steps, where one row per vreg took thousands
    assert est.est_grid_steps <= rows // 256, est.est_grid_steps
    for gen in TPU:
        sharding = jax.sharding.SingleDeviceSharding(topology_device(gen))
        aval = jax.ShapeDtypeStruct(big, jnp.float32, sharding=sharding)
        jax.jit(lambda x: kernel(x, *static)).trace(aval).lower().compile()
