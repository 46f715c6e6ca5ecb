"""Sorts, scatters through a permutation, and per-group masked dots: the MoE dispatch / weight-gradient
patterns the offline author used to refuse (issue 12, coverage). Interpret mode + AOT compile, small shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.render import render, undefined_names
from maxkernel.authors.offline.trace import Config, flatten, trace_reference
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.estimate import topology_device
from tests.offline_helpers import check_interpreted

TPU = ["v5e", "v6e"]


def _module(fn, configs: list[Config], names: list[str]):
    program = lower_program(trace_reference(fn, configs, names), "t")
    src = render(program, default_config(program, TPU), TPU)
    assert undefined_names(src) == []
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    return program, ns["computation"]


def _compiles(kernel, specs) -> None:
    for gen in TPU:
        sharding = jax.sharding.SingleDeviceSharding(topology_device(gen))
        avals = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in specs]
        jax.jit(kernel).trace(*avals).lower().compile()


def _prims(fn, specs) -> set[str]:
    return {e.primitive.name for e in flatten(fn, [jax.ShapeDtypeStruct(s, d) for s, d in specs]).jaxpr.eqns}


def dispatch_and_return(keys, y):
    """MoE-style dispatch: order rows by key (stable), scale them, and put them back in their places."""
    order = jnp.argsort(keys, stable=True)
    routed = y[order] * 2.0 + 1.0
    back = jnp.zeros_like(routed).at[order].set(routed)
    return back, jnp.sort(keys)


def test_argsort_becomes_ranks_and_the_scatter_back_a_gather() -> None:
    shapes = [((128,), (128, 128)), ((37,), (37, 5))]  # aligned, odd
    configs = [Config(dynamic=[(k, "int32"), (y, "float32")], static=[]) for k, y in shapes]
    prims = _prims(dispatch_and_return, [(shapes[0][0], jnp.int32), (shapes[0][1], jnp.float32)])
    assert not prims & {"sort", "scatter", "scatter-add"}
    program, kernel = _module(dispatch_and_return, configs, ["keys", "y"])
    rng = np.random.default_rng(3)
    for (ks, ys), hi in zip(shapes, (8, 3), strict=True):  # many ties: stability matters
        keys = rng.integers(0, hi, ks).astype(np.int32)
        y = rng.standard_normal(ys).astype(np.float32)
        check_interpreted(dispatch_and_return, kernel, (keys, y), atol=1e-6)
    _compiles(kernel, [((128,), jnp.int32), ((128, 128), jnp.float32)])


def tgmm(lhs, rhs, group_sizes):
    """out[g] = lhs[rows of g].T @ rhs[rows of g], written one group at a time (as a user would)."""
    ends = jnp.cumsum(group_sizes)
    row_group = jnp.searchsorted(ends, jnp.arange(lhs.shape[0]), side="right")

    def one_group(gid):
        masked = jnp.where((row_group == gid)[:, None], lhs, jnp.zeros_like(lhs))
        return jnp.dot(masked.T, rhs, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)

    return lax.map(one_group, jnp.arange(group_sizes.shape[0]))


@pytest.mark.parametrize(
    ("m", "k", "n", "sizes"),
    [
        (256, 128, 256, [28, 0, 100, 128]),  # aligned, an empty group, groups straddling blocks
        (77, 20, 9, [30, 11, 20]),  # odd shapes; rows past the last group belong to none
    ],
)
def test_per_group_masked_dots_become_one_ragged_contraction(m, k, n, sizes) -> None:
    g = len(sizes)
    configs = [Config(dynamic=[((m, k), "float32"), ((m, n), "float32"), ((g,), "int32")], static=[])]
    prims = _prims(tgmm, [((m, k), jnp.float32), ((m, n), jnp.float32), ((g,), jnp.int32)])
    assert "ragged_dot_general" in prims and not prims & {"dot_general", "gather"}  # one kernel, no copy
    program, kernel = _module(tgmm, configs, ["lhs", "rhs", "group_sizes"])
    assert [k.family for k in program.kernels] == ["grouped_matmul"]
    rng = np.random.default_rng(5)
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    rhs = rng.standard_normal((m, n)).astype(np.float32)
    check_interpreted(tgmm, kernel, (lhs, rhs, np.array(sizes, np.int32)), atol=1e-4)
    _compiles(kernel, [((m, k), jnp.float32), ((m, n), jnp.float32), ((g,), jnp.int32)])


def linear_cross_entropy(h, w, labels):
    logits = jnp.dot(h, w, preferred_element_type=jnp.float32)
    m = jnp.max(logits, axis=-1, keepdims=True)
    lse = jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1)) + m[:, 0]
    picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    return lse - picked


@pytest.mark.parametrize(("t", "d", "v"), [(128, 256, 512), (40, 136, 1003)])
def test_label_logit_is_picked_in_the_matmul_epilogue(t, d, v) -> None:
    """take_along_axis on the logits becomes a one-hot row sum, so the logits never leave the matmul kernel
    (a gather outside kernels would need them written to HBM)."""
    specs = [((t, d), "bfloat16"), ((d, v), "bfloat16"), ((t,), "int32")]
    assert "gather" not in _prims(linear_cross_entropy, [(s, jnp.dtype(x)) for s, x in specs])
    program, kernel = _module(linear_cross_entropy, [Config(dynamic=specs, static=[])], ["h", "w", "labels"])
    assert [k.family for k in program.kernels] == ["matmul_rowreduce"]
    rng = np.random.default_rng(7)
    h = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((d, v)) * d**-0.5, jnp.bfloat16)
    labels = rng.integers(0, v, t).astype(np.int32)
    check_interpreted(linear_cross_entropy, kernel, (h, w, labels), atol=1e-3)
    _compiles(kernel, [((t, d), jnp.bfloat16), ((d, v), jnp.bfloat16), ((t,), jnp.int32)])


def grouped(lhs, rhs, group_sizes):
    return lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)


@pytest.mark.parametrize(
    ("m", "k", "n", "sizes", "bm"),
    [
        (256, 256, 256, [64, 0, 100, 92], 64),  # aligned; an empty group; groups straddling row blocks
        (200, 136, 72, [50, 0, 37, 110], 32),  # odd shapes; 3 trailing rows in no group (they stay zero)
    ],
)
def test_grouped_matmul_row_blocks_visit_only_their_groups(m, k, n, sizes, bm) -> None:
    """Small row blocks, so each block visits a span of groups and the later group steps repeat the last
    (group, K block) index: the result must still be every group's rows times its own rhs."""
    from maxkernel.authors.base import TileConfig

    g = len(sizes)
    specs = [((m, k), "float32"), ((g, k, n), "float32"), ((g,), "int32")]
    program = lower_program(
        trace_reference(grouped, [Config(dynamic=specs, static=[])], ["lhs", "rhs", "group_sizes"]), "t"
    )
    vals = default_config(program, TPU).as_dict()
    vals.update({key: bm for key in vals if key.endswith("block_m")})
    vals.update({key: 128 for key in vals if key.endswith("block_k")})  # several K blocks too
    src = render(program, TileConfig.of(vals), TPU)
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    kernel = ns["computation"]
    rng = np.random.default_rng(9)
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    rhs = (rng.standard_normal((g, k, n)) * k**-0.5).astype(np.float32)
    check_interpreted(grouped, kernel, (lhs, rhs, np.array(sizes, np.int32)), atol=2e-2)
    _compiles(kernel, [((m, k), jnp.float32), ((g, k, n), jnp.float32), ((g,), jnp.int32)])
