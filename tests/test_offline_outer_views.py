"""A vector used along two axes of one kernel (an outer difference `c_i - c_j`, a pairwise distance, a decay
from a cumulative sum) is read as two views. The partitioner used to tie the vector's one axis to both axes
of the [.., S, S] value and stop with "a float equation failed to start its own region"; each view (the
vector as [.., S, 1] and as [.., 1, S]) is now glue, a copy the size of the vector, and the kernel reads the
two as separate operands. A long cumulative sum over the last axis of a multi-dim array is scanned in chunks
(its one-level form does n^2 work per row), which is what made such a view of glue in the first place."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.partition import FUSION_LEVELS
from maxkernel.authors.offline.render import render
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config


def pairwise(c, x):
    return x * jnp.exp(-jnp.abs(c[:, :, None] - c[:, None, :]))


def cumulative_decay(a, x):
    c = jnp.cumsum(a, axis=-1)
    return x * jnp.exp(jnp.minimum(c[:, :, None] - c[:, None, :], 0.0))


def _run(fn, big: int):
    configs = [
        Config(dynamic=[((b, s), "float32"), ((b, s, s), "float32")], static=[])
        for b, s in [(4, big), (2, 64), (3, 40)]
    ]
    program = lower_program(trace_reference(fn, configs, ["c", "x"]), "t", options=FUSION_LEVELS[0])
    src = render(program, default_config(program, ["v5e"]), ["v5e"])
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    rng = np.random.default_rng(0)
    for b, s in [(2, 64), (3, 40)]:
        c = jnp.asarray(rng.standard_normal((b, s)) * 0.1, jnp.float32)
        x = jnp.asarray(rng.standard_normal((b, s, s)), jnp.float32)
        with pltpu.force_tpu_interpret_mode():
            got = np.asarray(ns["computation"](c, x))
        np.testing.assert_allclose(got, np.asarray(fn(c, x)), rtol=1e-5, atol=1e-5)
    return program


def test_an_outer_difference_of_an_input_reads_two_views() -> None:
    program = _run(pairwise, 512)
    assert [k.family for k in program.kernels] == ["elementwise"]
    assert program.glue == ["broadcast_in_dim"]  # the two views: XLA copies of the [4, 512] vector


def test_an_outer_difference_of_a_long_cumulative_sum() -> None:
    program = _run(cumulative_decay, 1024)
    assert program.kernels[-1].family == "elementwise"
    assert "broadcast_in_dim" in program.glue
