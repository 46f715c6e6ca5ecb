"""Sorts, scatters through a permutation, and per-group masked dots: the MoE dispatch / weight-gradient
patterns the offline author used to refuse (issue 12, coverage). Interpret mode + AOT compile, small shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from offline_helpers import check_interpreted, compiles

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.render import render, undefined_names
from maxkernel.authors.offline.trace import Config, flatten, trace_reference
from maxkernel.authors.offline.tuning import default_config

TPU = ["v5e", "v6e"]


def _module(fn, configs: list[Config], names: list[str]):
    program = lower_program(trace_reference(fn, configs, names), "t")
    src = render(program, default_config(program, TPU), TPU)
    assert undefined_names(src) == []
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    return program, ns["computation"]


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
    compiles(kernel, [((128,), jnp.int32), ((128, 128), jnp.float32)])


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
    compiles(kernel, [((m, k), jnp.float32), ((m, n), jnp.float32), ((g,), jnp.int32)])


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
    compiles(kernel, [((t, d), jnp.bfloat16), ((d, v), jnp.bfloat16), ((t,), jnp.int32)])


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
    compiles(kernel, [((m, k), jnp.float32), ((g, k, n), jnp.float32), ((g,), jnp.int32)])


def route_and_return(logits, y, top_k):
    """MoE dispatch as references write it: argsort the flattened top-k expert ids (small-range integer
    keys), gather the routed rows, scatter the results back through the order."""
    top_w, top_i = lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    order = jnp.argsort(top_i.reshape(-1), stable=True)
    routed = y[order // top_k] * 2.0 + 1.0
    back = jnp.zeros_like(routed).at[order].set(routed).reshape(y.shape[0], top_k, y.shape[1])
    return jnp.sum(back * top_w[..., None], axis=1)


@pytest.mark.parametrize(
    ("t", "e", "top_k"),
    [
        (512, 8, 2),  # aligned: 1024 routed pairs, past the length sorted by comparisons
        (333, 5, 3),  # odd: 999 pairs over 5 experts, a chunk that does not divide
    ],
)
def test_small_range_keys_sort_by_counting_in_linear_work(t, e, top_k, monkeypatch) -> None:
    """top_k indices are keys in [0, e): the sort becomes a counting rank (one-hot cumulative counts) and a
    chunked search for the inverse, with no n x n comparison anywhere (at 2^16 routed pairs that block
    grew a compile past 12 GB and took the judge down)."""
    from maxkernel.authors.offline import trace
    from maxkernel.authors.offline.tuning import vmem_budget, vmem_estimate

    counted = []
    counting = trace._counting_sort_permutation
    monkeypatch.setattr(trace, "_counting_sort_permutation", lambda k, b: counted.append(b) or counting(k, b))
    d = 128
    specs = [((t, e), "float32"), ((t, d), "float32")]
    program, kernel = _module(
        lambda lg, y: route_and_return(lg, y, top_k), [Config(dynamic=specs, static=[])], ["logits", "y"]
    )
    assert counted == [e]  # the bound came from top_k's index result
    n = t * top_k
    for k in program.kernels:  # no block or intermediate anywhere near n x n
        assert all(p.extent < n * n // 4 for p in k.params)
        assert vmem_estimate(k, {p.name: p.default for p in k.params}) <= vmem_budget(TPU)
    rng = np.random.default_rng(11)
    logits = rng.standard_normal((t, e)).astype(np.float32)
    logits[: t // 3, 0] += 5.0  # a crowded expert: long runs of equal keys (stability matters)
    y = rng.standard_normal((t, d)).astype(np.float32)
    check_interpreted(lambda lg, yy: route_and_return(lg, yy, top_k), kernel, (logits, y), atol=1e-6)
    if (
        t % 128 == 0
    ):  # the AOT compile once (30 kernels, two generations): the odd case differs only in padding
        compiles(kernel, [((t, e), jnp.float32), ((t, d), jnp.float32)])


def test_a_kernel_far_beyond_vmem_is_refused_not_compiled() -> None:
    """A kernel whose own VMEM figure is far past any TPU's VMEM (the old n x n argsort rank at 2^16 routed
    pairs: 524808 MiB) is named by `oversized`, which the author's plan refuses at that fusion level instead
    of handing the compiler something that grew past 12 GB; a kernel that fits is not named."""
    from maxkernel.authors.offline.spec import BufferSpec, DimRef
    from maxkernel.authors.offline.tuning import oversized

    def by_key(keys, y):
        return y[jnp.argsort(keys, stable=True)]

    specs = [((256,), "int32"), ((256, 128), "float32")]
    program = lower_program(trace_reference(by_key, [Config(dynamic=specs, static=[])], ["keys", "y"]), "t")
    config = default_config(program, TPU)
    assert oversized(program, config, TPU) == []
    square = [DimRef(kind="full", extent=1 << 16), DimRef(kind="full", extent=1 << 16)]
    program.kernels[0].buffers.append(
        BufferSpec(what="rank mask", dims=square, itemsize=4, copies=1, kind="temporary")
    )
    found = oversized(program, config, TPU)
    assert len(found) == 1 and program.kernels[0].name in found[0] and "MiB of VMEM" in found[0]
