"""One map kernel over two independent computations that line up: a rotary embedding applied to the queries
and to a key broadcast over the heads (MLA's shared rope key). The two sides share the positions and the
frequencies and nothing else, so each side's batch and heads were axes of their own: every output was
written again at each step of the other side's axes, not consecutively (revisits that TPU interpret mode
refuses and a grid split over cores gets wrong), and the lanes held one element. The builder makes the
matching axes one (`MapBuilder._independent_pair`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.partition import FUSION_LEVELS
from maxkernel.authors.offline.render import render
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.estimate import topology_device

TPU = ["v5e", "v6e"]


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def rope_query_and_shared_key(q, k):
    """q: [B, S, H, D]; k: [B, S, D], one rope key shared by every head (broadcast, then rotated)."""
    b, s, h, d = q.shape
    freqs = 1.0 / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = jnp.outer(jnp.arange(s, dtype=jnp.float32), freqs)
    cos = jnp.cos(angles).astype(q.dtype)[None, :, None, :]
    sin = jnp.sin(angles).astype(q.dtype)[None, :, None, :]
    kb = jnp.broadcast_to(k[:, :, None, :], (b, s, h, d))
    return _rope(q, cos, sin), _rope(kb, cos, sin)


SHAPES = [((2, 256, 16, 64), (2, 256, 64)), ((2, 32, 16, 64), (2, 32, 64)), ((3, 24, 8, 64), (3, 24, 64))]


def test_rope_of_queries_and_a_shared_key_is_one_grid() -> None:
    configs = [Config(dynamic=[(q, "bfloat16"), (k, "bfloat16")], static=[]) for q, k in SHAPES]
    program = lower_program(
        trace_reference(rope_query_and_shared_key, configs, ["q", "k"]), "t", options=FUSION_LEVELS[0]
    )
    maps = [k for k in program.kernels if k.family == "elementwise"]
    assert len(maps) == 1
    src = render(program, default_config(program, TPU), TPU)
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    rng = np.random.default_rng(0)
    for qs, ks in SHAPES[1:]:
        q = jnp.asarray(rng.standard_normal(qs), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal(ks), jnp.bfloat16)
        with pltpu.force_tpu_interpret_mode():  # refuses an output block written again non-consecutively
            got = ns["computation"](q, k)
        for g, w in zip(got, rope_query_and_shared_key(q, k), strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_allclose(
                np.asarray(g, np.float32), np.asarray(w, np.float32), atol=1e-2, rtol=1e-2
            )
    for gen in TPU:
        sharding = jax.sharding.SingleDeviceSharding(topology_device(gen))
        avals = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in SHAPES[0]]
        jax.jit(ns["computation"]).trace(*avals).lower().compile()
