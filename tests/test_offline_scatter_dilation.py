"""Transposed convolutions. A scatter onto zeros at a strided grid of points (`zeros.at[:, ::2, ::2, :].set(x)`,
the input dilation a transposed convolution is written with by hand) is traced as `lax.pad` with interior
padding: exact, layout glue instead of a data-dependent write the offline author had to refuse ("a scatter
other than whole rows"); other index sets keep their own handling. A convolution of such a dilated input, or
one with `lhs_dilation` (`lax.conv_transpose`, refused before as "a transposed (input-dilated) convolution"),
becomes one stride-1 convolution of the undilated input per output phase, so the inserted zeros are never
multiplied."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import tpu as pltpu

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.partition import FUSION_LEVELS
from maxkernel.authors.offline.render import render
from maxkernel.authors.offline.trace import Config, Unsupported, _strided_grid, flatten, trace_reference
from maxkernel.authors.offline.tuning import default_config


def transposed_conv(x, w):
    """A stride-2 transposed convolution as people write it: dilate with zeros, then a plain convolution."""
    n, h, wd, c = x.shape
    d = jnp.zeros((n, 2 * h - 1, 2 * wd - 1, c), x.dtype).at[:, ::2, ::2, :].set(x)
    y = lax.conv_general_dilated(d, w, (1, 1), ((2, 2), (2, 2)), dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jax.nn.relu(y + 1.0)


def _conv_flops(eqns) -> int:
    total = 0
    for e in eqns:
        if e.primitive.name == "conv_general_dilated":
            dn = e.params["dimension_numbers"]
            w = e.invars[1].aval.shape
            taps = int(np.prod([w[d] for d in dn.rhs_spec[1:]]))
            total += 2 * int(np.prod(e.outvars[0].aval.shape)) * taps
        elif e.primitive.name == "dot_general":
            (lc, _), _ = e.params["dimension_numbers"]
            k = int(np.prod([e.invars[0].aval.shape[d] for d in lc]))
            total += 2 * int(np.prod(e.outvars[0].aval.shape)) * k
    return total


def offset_add(x):
    """Every third row from row 1, added onto zeros (a scatter-add)."""
    return jnp.zeros((3 * x.shape[0], x.shape[1]), x.dtype).at[1::3].add(x) * 2.0


def permuted_rows(x, idx):
    """Rows written at data-dependent places: not a dilation."""
    return jnp.zeros_like(x).at[idx].set(x)


def _prims(fn, *specs):
    return [e.primitive.name for e in flatten(fn, specs).jaxpr.eqns]


def test_a_strided_scatter_onto_zeros_is_an_interior_pad() -> None:
    prims = _prims(transposed_conv, jax.ShapeDtypeStruct((2, 8, 8, 16), jnp.float32),
                   jax.ShapeDtypeStruct((3, 3, 16, 32), jnp.float32))  # fmt: skip
    assert "scatter" not in prims and "pad" in prims
    eqns = flatten(offset_add, [jax.ShapeDtypeStruct((10, 128), jnp.float32)]).jaxpr.eqns
    pad = next(e for e in eqns if e.primitive.name == "pad")
    assert tuple(pad.params["padding_config"][0]) == (1, 1, 2)  # row 1, then every third, one row after


def test_other_scatters_are_not_taken_for_dilations() -> None:
    prims = _prims(permuted_rows, jax.ShapeDtypeStruct((64, 128), jnp.float32),
                   jax.ShapeDtypeStruct((64,), jnp.int32))  # fmt: skip
    assert "pad" not in prims
    grid = np.stack(np.meshgrid(np.arange(4) * 2, np.arange(3) + 5, indexing="ij"), axis=-1)
    assert _strided_grid(grid, 2) == [(0, 0, 2), (1, 5, 1)]
    assert _strided_grid(grid[::-1], 2) is None  # a descending progression
    assert _strided_grid(np.array([[0], [1], [3]]), 1) is None  # not arithmetic


@pytest.mark.parametrize(("fn", "shapes"), [(transposed_conv, None), (offset_add, None)])
def test_the_dilated_program_is_a_correct_kernel(fn, shapes) -> None:
    if fn is transposed_conv:

        def cfg(n: int, s: int) -> Config:
            return Config(dynamic=[((n, s, s, 16), "float32"), ((3, 3, 16, 32), "float32")], static=[])

        configs, names, small = [cfg(8, 32), cfg(2, 8), cfg(2, 12)], ["x", "w"], [(2, 8), (2, 12)]
        make = lambda n, s: [(n, s, s, 16), (3, 3, 16, 32)]  # noqa: E731
    else:

        def cfg(n: int, s: int) -> Config:
            return Config(dynamic=[((n, s), "float32")], static=[])

        configs, names, small = [cfg(256, 256), cfg(16, 128), cfg(24, 256)], ["x"], [(16, 128), (24, 256)]
        make = lambda n, s: [(n, s)]  # noqa: E731
    traces = trace_reference(fn, configs, names, direct_conv=True)
    assert "scatter_into_zeros" in traces.rewritten
    try:
        program = lower_program(traces, "t", FUSION_LEVELS[0])
    except Unsupported as e:  # pragma: no cover - the point of the rewrite
        pytest.fail(f"refused after the rewrite: {e}")
    src = render(program, default_config(program, ["v5e"]), ["v5e"])
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    rng = np.random.default_rng(0)
    for n, s in small:
        args = [jnp.asarray(rng.standard_normal(sh), jnp.float32) for sh in make(n, s)]
        with pltpu.force_tpu_interpret_mode():
            got = np.asarray(ns["computation"](*args))
        np.testing.assert_allclose(got, np.asarray(fn(*args)), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize(
    ("xs", "ws", "strides", "padding", "rhs_dilation"),
    [
        ((2, 7, 9, 4), (3, 3, 4, 5), (2, 2), "SAME", None),
        ((2, 7, 9, 4), (4, 4, 4, 5), (2, 2), "VALID", None),
        ((1, 5, 6, 3), (3, 2, 3, 2), (3, 2), ((1, 2), (0, 1)), None),  # a phase with no tap along one dim
        ((2, 4, 5, 6, 3), (4, 4, 4, 3, 2), (2, 2, 2), ((2, 2), (2, 2), (2, 2)), None),
        # kernel dilation: coprime with the stride, a multiple of it, and sharing a factor with it
        ((1, 6, 5, 3), (3, 2, 3, 2), (3, 2), ((1, 2), (2, 1)), (2, 3)),
        ((1, 6, 5, 3), (2, 3, 3, 2), (2, 4), "VALID", (4, 2)),
        ((2, 7, 9, 4), (3, 3, 4, 5), (2, 2), "SAME", (2, 2)),
    ],
)
def test_a_transposed_convolution_is_one_plain_convolution_per_phase(
    xs, ws, strides, padding, rhs_dilation
) -> None:
    dn = ("NHWC", "HWIO", "NHWC") if len(xs) == 4 else ("NDHWC", "DHWIO", "NDHWC")

    def fn(x, w):
        return lax.conv_transpose(x, w, strides, padding, rhs_dilation=rhs_dilation, dimension_numbers=dn)

    specs = [jax.ShapeDtypeStruct(xs, jnp.float32), jax.ShapeDtypeStruct(ws, jnp.float32)]
    flat = flatten(fn, specs)
    convs = [e for e in flat.jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
    assert all(all(int(d) == 1 for d in e.params["lhs_dilation"]) for e in convs)
    rng = np.random.default_rng(1)
    x, w = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (xs, ws))
    got = jax.core.eval_jaxpr(flat.jaxpr, flat.consts, x, w)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(fn(x, w)), atol=1e-4, rtol=1e-5)


def test_the_dilation_zeros_are_never_multiplied() -> None:
    specs = [
        jax.ShapeDtypeStruct((2, 16, 16, 32), jnp.float32),
        jax.ShapeDtypeStruct((3, 3, 32, 32), jnp.float32),
    ]
    dilated = _conv_flops(jax.make_jaxpr(transposed_conv)(*specs).jaxpr.eqns)
    phased = _conv_flops(flatten(transposed_conv, specs).jaxpr.eqns)
    assert phased <= dilated / 3  # 2 x 2 phases: about a quarter of the products are of real inputs
