"""Attention on [B, S, H, D] operands (the layout model code keeps q, k, v and the output in) is read and
written in place: with a head dim of 128-multiples the head is the lane-block index of the free
[B, S, H * D] view, so the wrapper moves nothing through HBM (it transposed every operand to [B, H, S, D]
and the output back). A 64-wide head dim keeps the transposes. Correct in TPU interpret mode (causal and
not), and compiled for v5e and v6e ahead of time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.partition import FUSION_LEVELS
from maxkernel.authors.offline.render import render
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.estimate import estimate_pallas, topology_device

TPU = ["v5e", "v6e"]


def seq_major(q, k, v):
    d = q.shape[-1]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * d**-0.5
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)


def seq_major_causal(q, k, v):
    d, n = q.shape[-1], q.shape[1]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * d**-0.5
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)


def _program(fn, d: int):
    configs = [
        Config(dynamic=[((b, s, h, d), "bfloat16")] * 3, static=[])
        for b, s, h in [(2, 512, 4), (1, 64, 2), (1, 48, 3)]
    ]
    return lower_program(trace_reference(fn, configs, ["q", "k", "v"]), "t", options=FUSION_LEVELS[0])


@pytest.mark.parametrize("fn", [seq_major, seq_major_causal])
def test_heads_ride_in_the_lanes(fn) -> None:
    program = _program(fn, 128)
    (kernel,) = program.kernels
    assert kernel.family == "attention"
    src = render(program, default_config(program, TPU), TPU)
    wrapper = src.split("def computation", 1)[0].rsplit("def _attention(", 1)[1]
    assert "jnp.transpose" not in wrapper
    assert wrapper.count("heads merged into the lanes") == 3 and "the heads out of the lanes" in wrapper
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    rng = np.random.default_rng(0)
    for shape in [(1, 64, 2, 128), (1, 48, 3, 128)]:
        args = [jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3)]
        with pltpu.force_tpu_interpret_mode():
            got = np.asarray(ns["computation"](*args), np.float32)
        want = np.asarray(fn(*args), np.float32)
        np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)
    for gen in TPU:
        sharding = jax.sharding.SingleDeviceSharding(topology_device(gen))
        avals = [jax.ShapeDtypeStruct((2, 512, 4, 128), jnp.bfloat16, sharding=sharding)] * 3
        jaxpr = jax.make_jaxpr(ns["computation"])(*avals)
        assert estimate_pallas(jaxpr, gen).est_xla_bytes == 0  # nothing moves outside the kernel
        jax.jit(ns["computation"]).trace(*avals).lower().compile()


def test_a_narrow_head_dim_keeps_the_transposes() -> None:
    program = _program(seq_major, 64)
    src = render(program, default_config(program, TPU), TPU)
    assert "heads merged into the lanes" not in src and "jnp.transpose" in src
