"""A scan whose state is too large for VMEM, read and written through row windows: a loop over groups that
multiplies a window of token rows by the group's weights and adds the result into a window of a carried
output (the grouped-matmul reference of a mixture of experts, written here as a `fori_loop`). The offline
author keeps the carry and the operands in HBM and moves windows by DMA; the kernel must equal the loop
exactly, also where `dynamic_slice` clamps a window that runs past the end and where windows overlap, and
compile for the TPU. References are the tests' own code (traced in-process)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from offline_helpers import compiles, load_module

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.trace import Config, Unsupported, trace_reference


def grouped_rows(x, w, offsets, counts, rows):
    """Group g multiplies `rows` token rows from offsets[g] by w[g]; rows past counts[g] add nothing."""
    m, k = x.shape
    n = w.shape[2]

    def body(g, acc):
        xs = lax.dynamic_slice(x, (offsets[g], 0), (rows, k))
        y = jnp.dot(xs, w[g], preferred_element_type=jnp.float32)
        y = jnp.where(lax.broadcasted_iota(jnp.int32, (rows, n), 0) < counts[g], y, 0.0).astype(acc.dtype)
        cur = lax.dynamic_slice(acc, (offsets[g], 0), (rows, n))
        return lax.dynamic_update_slice(acc, cur + y, (offsets[g], 0))

    out = lax.fori_loop(0, w.shape[0], body, jnp.zeros((m + rows, n), x.dtype))
    return out[:m]


def _config(m: int, k: int, n: int, g: int, rows: int) -> Config:
    return Config(dynamic=[((m, k), "bfloat16"), ((g, k, n), "bfloat16"), ((g,), "int32"), ((g,), "int32")],
                  static=[rows])  # fmt: skip


CONFIGS = [_config(512, 256, 256, 8, 64), _config(256, 128, 256, 4, 32)]


@pytest.fixture(scope="module")
def generated():
    program = lower_program(
        trace_reference(grouped_rows, CONFIGS, ["x", "w", "offsets", "counts", "rows"]), "t"
    )
    src, kernel = load_module(program)
    return program, src, kernel


def _inputs(m, k, n, g, offsets, counts, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n)) * 0.1, jnp.bfloat16)
    return x, w, jnp.asarray(offsets, jnp.int32), jnp.asarray(counts, jnp.int32)


def test_the_loop_is_one_kernel_with_its_carry_in_hbm(generated) -> None:
    program, src, _kernel = generated
    scans = [k for k in program.kernels if k.family == "scan"]
    assert len(scans) == 1 and "carry in HBM" in scans[0].title
    code = scans[0].code
    assert "memory_space=pl.ANY" in code and "make_async_copy" in code and "input_output_aliases" in code
    assert "PrefetchScalarGridSpec" in code and '"arbitrary"' in code
    assert "pltpu.roll" in code  # a window of rows of a 2-D array starts on any row


@pytest.mark.parametrize(
    ("offsets", "counts"),
    [
        ([0, 64, 128, 192, 256, 320, 384, 448], [64] * 8),  # every group full, aligned
        ([0, 5, 70, 133, 200, 261, 330, 401], [5, 65, 63, 67, 61, 69, 71, 40]),  # unaligned, counts past rows
        (
            [0, 3, 3, 500, 470, 511, 100, 90],
            [3, 0, 64, 64, 30, 64, 20, 64],
        ),  # clamped at the end, overlapping
    ],
)
def test_the_kernel_is_the_loop_exactly(generated, offsets, counts) -> None:
    _program, _src, kernel = generated
    args = _inputs(512, 256, 256, 8, offsets, counts)
    with pltpu.force_tpu_interpret_mode():
        got = kernel(*args, 64)
    want = jax.jit(grouped_rows, static_argnums=4)(*args, 64)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_the_other_configuration_runs_the_same_code(generated) -> None:
    _program, _src, kernel = generated
    args = _inputs(256, 128, 256, 4, [0, 17, 100, 230], [17, 32, 30, 32], seed=1)
    with pltpu.force_tpu_interpret_mode():
        got = kernel(*args, 32)
    want = jax.jit(grouped_rows, static_argnums=4)(*args, 32)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_it_compiles_for_the_tpu(generated) -> None:
    _program, _src, kernel = generated
    specs = [((512, 256), jnp.bfloat16), ((8, 256, 256), jnp.bfloat16), ((8,), jnp.int32), ((8,), jnp.int32)]
    compiles(functools.partial(kernel, rows=64), specs)


def whole_weights(x, w, offsets, rows):
    """The loop also reads its weights whole (a sum over them): not a window, refused by name."""
    m, k = x.shape

    def body(g, acc):
        xs = lax.dynamic_slice(x, (offsets[g], 0), (rows, k))
        y = (xs * jnp.sum(w)).astype(acc.dtype)
        cur = lax.dynamic_slice(acc, (offsets[g], 0), (rows, k))
        return lax.dynamic_update_slice(acc, cur + y, (offsets[g], 0))

    return lax.fori_loop(0, offsets.shape[0], body, jnp.zeros((m + rows, k), x.dtype))


def test_an_operand_read_whole_inside_a_windowed_loop_is_refused_by_name() -> None:
    cfg = Config(dynamic=[((256, 128), "float32"), ((4, 128), "float32"), ((4,), "int32")], static=[32])
    with pytest.raises(Unsupported, match="used other than through one window"):
        lower_program(trace_reference(whole_weights, [cfg], ["x", "w", "offsets", "rows"]), "t")


def paged_updates(x, idx, w):
    """A reversed scan over a [pages, 8, 128] pool: page idx[g] gains (page idx[g]) @ w[g]. Windows of rank 3
    slice the untiled first dim directly; a page hit twice sees its first update."""

    def body(acc, g):
        i = idx[g]
        page = lax.dynamic_slice(x, (i, 0, 0), (1, 8, 128))[0]
        y = jnp.dot(page, w[g], preferred_element_type=jnp.float32)
        cur = lax.dynamic_slice(acc, (i, 0, 0), (1, 8, 128))
        return lax.dynamic_update_slice(acc, cur + y[None], (i, 0, 0)), None

    out, _ = lax.scan(body, jnp.zeros_like(x), jnp.arange(idx.shape[0]), reverse=True)
    return out


def test_a_reversed_scan_over_pages_of_a_pool_is_exact() -> None:
    cfgs = [
        Config(dynamic=[((16, 8, 128), "float32"), ((6,), "int32"), ((6, 128, 128), "float32")], static=[]),
        Config(dynamic=[((12, 8, 128), "float32"), ((4,), "int32"), ((4, 128, 128), "float32")], static=[]),
    ]
    program = lower_program(trace_reference(paged_updates, cfgs, ["x", "idx", "w"]), "t")
    assert [k.family for k in program.kernels] == ["scan"] and "pltpu.roll" not in program.kernels[0].code
    _src, kernel = load_module(program)
    rng = np.random.default_rng(2)
    for pages, idx in [(16, [3, 3, 15, 0, 7, 3]), (12, [11, 2, 2, 5])]:
        x = jnp.asarray(rng.standard_normal((pages, 8, 128)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((len(idx), 128, 128)) * 0.1, jnp.float32)
        args = (x, jnp.asarray(idx, jnp.int32), w)
        with pltpu.force_tpu_interpret_mode():
            got = kernel(*args)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(paged_updates)(*args)))
    compiles(kernel, [((16, 8, 128), jnp.float32), ((6,), jnp.int32), ((6, 128, 128), jnp.float32)])
