"""Families the offline author used to refuse: scans with a carried state (a kernel of their own),
cumulative sums/maxima and `searchsorted` (rewritten at trace time into masked reductions that the
existing families fuse). Each: correct in TPU interpret mode on aligned and odd shapes, and an
ahead-of-time Mosaic compile for v5e and v6e. References are the tests' own code (traced in-process)."""

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


def _cfg(*arrays: tuple[tuple[int, ...], str]) -> Config:
    return Config(dynamic=list(arrays), static=[])


def linear_recurrence(states, decay):
    """The inter-chunk state pass of a chunked SSD scan: h_t = decay_t * h_{t-1} + s_t, emitting h_{t-1}."""

    def step(carry, inp):
        st, d = inp
        return carry * d[:, :, None, None] + st, carry

    last, prev = lax.scan(step, jnp.zeros(states.shape[1:], jnp.float32), (states, decay))
    return prev, last


def test_scan_with_a_carry_is_one_sequential_kernel() -> None:
    configs = [
        _cfg(((6, 2, 4, 16, 128), "float32"), ((6, 2, 4), "float32")),
        _cfg(((5, 2, 3, 9, 20), "float32"), ((5, 2, 3), "float32")),  # odd sizes, another length
    ]
    program, kernel = _module(linear_recurrence, configs, ["states", "decay"])
    assert [k.family for k in program.kernels] == ["scan"]
    code = program.kernels[0].code
    assert '"arbitrary"' in code and "carry0_ref" in code and "pl.when(t_index == 0)" in code
    rng = np.random.default_rng(0)
    for shape in [(6, 2, 4, 16, 128), (5, 2, 3, 9, 20)]:
        st = rng.standard_normal(shape).astype(np.float32)
        dec = rng.uniform(0.5, 1.0, shape[:3]).astype(np.float32)
        check_interpreted(linear_recurrence, kernel, (st, dec))
    compiles(kernel, [((6, 2, 4, 16, 128), jnp.float32), ((6, 2, 4), jnp.float32)])


def reverse_running_max(x):
    def step(carry, row):
        new = jnp.maximum(carry, row)
        return new, new * 0.5

    return lax.scan(step, jnp.full(x.shape[1:], -1.0, x.dtype), x, reverse=True)


def test_reverse_scan_walks_backwards() -> None:
    configs = [_cfg(((8, 16, 128), "float32")), _cfg(((3, 5, 7), "float32"))]
    program, kernel = _module(reverse_running_max, configs, ["x"])
    assert [k.family for k in program.kernels] == ["scan"]
    rng = np.random.default_rng(1)
    for shape in [(8, 16, 128), (3, 5, 7)]:
        check_interpreted(reverse_running_max, kernel, (rng.standard_normal(shape).astype(np.float32),))
    compiles(kernel, [((8, 16, 128), jnp.float32)])


def chunk_decay(dt, a):
    """SSD's in-chunk log decay: a cumulative sum along the chunk axis, then exp."""
    return jnp.exp(jnp.cumsum(dt * a, axis=1))


def test_cumsum_becomes_a_masked_reduction_inside_a_kernel() -> None:
    configs = [
        _cfg(((16, 128, 8), "float32"), ((8,), "float32")),
        _cfg(((3, 33, 5), "float32"), ((5,), "float32")),
    ]
    program, kernel = _module(chunk_decay, configs, ["dt", "a"])
    assert "cumsum" not in "".join(k.code for k in program.kernels)
    rng = np.random.default_rng(2)
    for s in [(16, 128, 8), (3, 33, 5)]:
        dt = rng.uniform(0, 0.1, s).astype(np.float32)
        a = -rng.uniform(0.5, 2, s[-1:]).astype(np.float32)
        check_interpreted(chunk_decay, kernel, (dt, a))
    compiles(kernel, [((16, 128, 8), jnp.float32), ((8,), jnp.float32)])


@pytest.mark.parametrize("side", ["left", "right"])
def test_searchsorted_and_integer_cumsum_become_counts(side: str) -> None:
    def row_group(sizes, x):
        ends = jnp.cumsum(sizes)
        g = jnp.searchsorted(ends, jnp.arange(x.shape[0]), side=side)
        return x * g[:, None].astype(x.dtype)

    flat = flatten(
        row_group, [jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((64, 128), jnp.float32)]
    )
    prims = {e.primitive.name for e in flat.jaxpr.eqns}
    assert not prims & {"cumsum", "scan", "while", "jit", "pjit"}, prims
    configs = [_cfg(((4,), "int32"), ((64, 128), "float32")), _cfg(((3,), "int32"), ((37, 5), "float32"))]
    _, kernel = _module(row_group, configs, ["sizes", "x"])
    rng = np.random.default_rng(3)
    for sizes, shape in [
        (np.array([10, 0, 30, 24], np.int32), (64, 128)),
        (np.array([5, 32, 0], np.int32), (37, 5)),
    ]:
        check_interpreted(row_group, kernel, (sizes, rng.standard_normal(shape).astype(np.float32)))
    compiles(kernel, [((4,), jnp.int32), ((64, 128), jnp.float32)])


def scatter_rows(x, idx, u, c):
    """Row scatters as references write them: a histogram (scatter-add) and rows put back by index."""
    counts = jnp.zeros((x.shape[0],), jnp.int32).at[c].add(1)
    placed = x.at[idx].set(u)
    return placed * counts[:, None].astype(x.dtype), x.at[idx].add(u)


def test_small_scatters_become_one_hot_reductions() -> None:
    flat = flatten(
        scatter_rows,
        [
            jax.ShapeDtypeStruct((16, 128), jnp.float32),
            jax.ShapeDtypeStruct((5,), jnp.int32),
            jax.ShapeDtypeStruct((5, 128), jnp.float32),
            jax.ShapeDtypeStruct((6,), jnp.int32),
        ],
    )
    assert not {e.primitive.name for e in flat.jaxpr.eqns} & {"scatter", "scatter-add"}
    configs = [
        _cfg(((16, 128), "float32"), ((5,), "int32"), ((5, 128), "float32"), ((6,), "int32")),
        _cfg(((9, 7), "float32"), ((3,), "int32"), ((3, 7), "float32"), ((4,), "int32")),
    ]
    program, kernel = _module(scatter_rows, configs, ["x", "idx", "u", "c"])
    rng = np.random.default_rng(4)
    cases = [
        ((16, 128), np.array([3, 1, 3, 15, 20], np.int32), np.array([1, 1, 5, 15, 40, 2], np.int32)),
        ((9, 7), np.array([8, 0, 4], np.int32), np.array([0, 8, 8, 3], np.int32)),
    ]
    for shape, idx, c in cases:  # a repeated index (the last update wins) and out-of-range ones (dropped)
        x = rng.standard_normal(shape).astype(np.float32)
        u = rng.standard_normal((len(idx), shape[1])).astype(np.float32)
        check_interpreted(scatter_rows, kernel, (x, idx, u, c))
    compiles(
        kernel,
        [((16, 128), jnp.float32), ((5,), jnp.int32), ((5, 128), jnp.float32), ((6,), jnp.int32)],
    )


def conv2d_relu(x, w):
    y = lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=lax.Precision.HIGHEST
    )
    return jax.nn.relu(y)


def conv3d_valid_nchw(x, w):
    return lax.conv_general_dilated(x, w, (1, 1, 1), "VALID", dimension_numbers=("NCDHW", "OIDHW", "NCDHW"))


@pytest.mark.parametrize(
    ("fn", "shapes", "dtype", "atol"),
    [
        (conv2d_relu, [((2, 16, 16, 8), (3, 3, 8, 128)), ((1, 9, 11, 3), (3, 3, 3, 5))], "float32", 1e-4),
        (
            conv3d_valid_nchw,
            [((1, 4, 6, 8, 16), (8, 4, 3, 3, 3)), ((2, 3, 5, 6, 7), (5, 3, 3, 3, 3))],
            "bfloat16",
            0.1,
        ),
    ],
)
def test_stride_one_convolutions_are_direct_kernels_without_im2col(fn, shapes, dtype, atol) -> None:
    configs = [_cfg((xs, dtype), (ws, dtype)) for xs, ws in shapes]
    program = lower_program(trace_reference(fn, configs, ["x", "w"], direct_conv=True), "t")
    assert program.kernels[0].family == "conv"
    assert "concatenate" not in program.computation_code  # no patches array
    default = default_config(program, TPU)
    rng = np.random.default_rng(5)
    # the default blocks, and 2-row blocks: several halo'd input blocks that overlap, and a padded last one
    for config in (default, default.replace(block_rows=2)):
        src = render(program, config, TPU)
        assert undefined_names(src) == [] and "pl.Element(" in src
        ns: dict = {}
        exec(compile(src, "generated", "exec"), ns)
        for xs, ws in shapes:
            x = jnp.asarray(rng.standard_normal(xs), dtype)
            w = jnp.asarray(0.2 * rng.standard_normal(ws), dtype)
            check_interpreted(fn, ns["computation"], (x, w), atol=atol)
        compiles(ns["computation"], [(shapes[0][0], jnp.dtype(dtype)), (shapes[0][1], jnp.dtype(dtype))])


def test_strided_convolutions_keep_the_patches_path() -> None:
    def patch_embed(x, w):
        return lax.conv_general_dilated(x, w, (4, 4), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    configs = [_cfg(((2, 16, 16, 3), "float32"), ((4, 4, 3, 128), "float32"))]
    program = lower_program(trace_reference(patch_embed, configs, ["x", "w"], direct_conv=True), "t")
    assert [k.family for k in program.kernels] != ["conv"]
    assert program.family.startswith("conv_")  # im2col patches (a reshape here: stride = window) + matmul


def test_every_family_is_one_table_entry() -> None:
    from maxkernel.authors.offline.families import EQUATION_KINDS, FAMILIES, builder_for
    from maxkernel.authors.offline.kernels import KernelBuilder

    kinds = [f.kind for f in FAMILIES]
    assert len(kinds) == len(set(kinds))
    for f in FAMILIES:
        assert issubclass(builder_for(f.kind), KernelBuilder), f.kind
        assert f.starts and f.doc
    assert EQUATION_KINDS == {"ragged_dot_general": "ragged", "scan": "scan", "conv_general_dilated": "conv"}
