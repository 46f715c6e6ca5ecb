"""Mixed prefill and decode attention over a token buffer: each sequence's query rows are read at a
data-dependent offset, attend to the sequence's own K/V pages (grouped heads, a causal offset and a length
mask built from iotas and per-sequence scalars), and are added back into the buffer with a scatter of whole
rows (`out.at[rows].add(o)`), one sequence after another in a Python loop.

What the offline author must do with it: the row scatter too large for a one-hot reduction stays XLA's
in-place scatter between the attention kernels (the harness allows it by its cost, as a small reduction),
the masks are rebuilt on the grouped heads and computed inside each attention kernel (not written to HBM
by a map kernel and read back), and the result equals the loop. References are the tests' own code."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from offline_helpers import check_interpreted, compiles, load_module

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.offline import trace as trace_mod
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.tools.checks import check_pallas_does_work

CAPACITIES = (1, 1, 16, 24)
"""Static query rows per sequence slot: two decode tokens, then two prefill chunks."""
PAGE = 16


def mixed_batch_attention(tokens, pages, lengths, table, bounds):
    """tokens [T, Hq, D]; pages [P, PAGE, 2 * Hkv, D] (K and V heads interleaved); lengths [S] (context
    length per sequence); table [S, pages per sequence]; bounds [S + 1] (each sequence's first token)."""
    n_tok, hq, d = tokens.shape
    hkv = pages.shape[2] // 2
    result = jnp.zeros_like(tokens)
    for s, cap in enumerate(CAPACITIES):
        first = bounds[s]
        count = bounds[s + 1] - first
        rows = jnp.minimum(first + jnp.arange(cap, dtype=jnp.int32), n_tok - 1)
        q = tokens[rows]
        k = pages[table[s], :, 0::2, :].reshape(-1, hkv, d)
        v = pages[table[s], :, 1::2, :].reshape(-1, hkv, d)
        k = jnp.repeat(k, hq // hkv, axis=1)
        v = jnp.repeat(v, hq // hkv, axis=1)
        logits = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(d)
        pos = (lengths[s] - count) + lax.broadcasted_iota(jnp.int32, logits.shape, 1)
        key = lax.broadcasted_iota(jnp.int32, logits.shape, 2)
        logits = jnp.where((key > pos) | (key >= lengths[s]), -1e30, logits)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        o = jnp.einsum("hqk,khd->qhd", probs, v).astype(tokens.dtype)
        o = jnp.where((jnp.arange(cap) < count)[:, None, None], o, 0)
        result = result.at[rows].add(o)
    return result


def _config(n_tok: int, hq: int, hkv: int, d: int, n_pages: int, per_seq: int) -> Config:
    s = len(CAPACITIES)
    return Config(
        dynamic=[
            ((n_tok, hq, d), "bfloat16"),
            ((n_pages, PAGE, 2 * hkv, d), "bfloat16"),
            ((s,), "int32"),
            ((s, per_seq), "int32"),
            ((s + 1,), "int32"),
        ],
        static=[],
    )


CONFIGS = [_config(48, 8, 2, 128, 32, 4), _config(48, 4, 2, 128, 32, 4)]


def _inputs(cfg: Config, lengths: list[int], seed: int = 0):
    rng = np.random.default_rng(seed)
    (tok, pages, _lens, table, _bounds) = [shape for shape, _dtype in cfg.dynamic]
    tokens = jnp.asarray(rng.standard_normal(tok), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal(pages), jnp.bfloat16)
    perm = rng.permutation(pages[0])[: table[0] * table[1]].reshape(table)
    starts = np.concatenate([[0], np.cumsum(CAPACITIES)]).astype(np.int32)
    return tokens, kv, jnp.asarray(lengths, jnp.int32), jnp.asarray(perm, jnp.int32), jnp.asarray(starts)


@pytest.fixture(scope="module")
def generated():
    with pytest.MonkeyPatch.context() as mp:
        # the rule is by size (a one-hot over a 4096-token buffer is too large); these shapes are small
        mp.setattr(trace_mod, "SCATTER_MAX_ELEMS", 0)
        program = lower_program(
            trace_reference(
                mixed_batch_attention, CONFIGS, ["tokens", "pages", "lengths", "table", "bounds"]
            ),
            "t",
        )
    src, kernel = load_module(program)
    return program, src, kernel


def test_attention_kernels_with_the_row_scatter_left_to_xla(generated) -> None:
    program, src, _kernel = generated
    families = [k.family for k in program.kernels]
    assert families == ["attention"] * len(CAPACITIES), families  # no mask kernel, no one-hot scatter
    assert src.count("lax.scatter_add(") == len(CAPACITIES)
    for k in program.kernels:  # the masks are computed per block: no [heads, q, kv] input
        assert "broadcasted_iota" in k.code


@pytest.mark.parametrize(
    "lengths",
    [
        [40, 64, 16, 50],  # contexts ending mid-page; prefill chunks at the end of their context
        [1, 17, 64, 24],  # a one-token context, a full one
    ],
)
def test_equals_the_loop(generated, lengths) -> None:
    _program, _src, kernel = generated
    args = _inputs(CONFIGS[0], lengths)
    check_interpreted(mixed_batch_attention, kernel, args, atol=2e-2, rtol=2e-2)


def test_the_pallas_check_allows_the_scatter_by_its_cost(generated) -> None:
    _program, _src, kernel = generated
    args = _inputs(CONFIGS[0], [40, 64, 16, 50])
    check, _warnings = check_pallas_does_work(jax.make_jaxpr(kernel)(*args))
    assert check.ok, check.reason
    assert check.pallas_calls == len(CAPACITIES)


def test_compiles_for_the_tpu(generated) -> None:
    _program, _src, kernel = generated
    specs = [
        (shape, jnp.dtype(dtype) if dtype != "bfloat16" else jnp.bfloat16)
        for shape, dtype in CONFIGS[0].dynamic
    ]
    compiles(kernel, specs, ["v5e"])


def _three_maps(x, y, z, w):
    return jnp.concatenate([jnp.sin(x), jnp.cos(y), jnp.tanh(z)], axis=0) @ w


def test_unrelated_maps_are_not_one_kernel_over_the_product_of_their_axes() -> None:
    """Three values of the same shape but unrelated axes (computed from different inputs, needed by a
    concatenate: as the masked outputs of a ragged batch's sequences are) were written by one map kernel
    whose grid was the product of all their axes (2^31 steps for a batch step of 28 sequences). A map
    kernel now holds at most two such computations, whose axes the builder lines up: a 2-D grid each."""
    configs = [
        Config(dynamic=[((256, 512), "float32")] * 3 + [((512, 256), "float32")], static=[]),
        Config(dynamic=[((64, 256), "float32")] * 3 + [((256, 128), "float32")], static=[]),
    ]
    program = lower_program(trace_reference(_three_maps, configs, ["x", "y", "z", "w"]), "t")
    maps = [k for k in program.kernels if k.family == "elementwise"]
    assert len(maps) == 2 and all(len(k.grid) == 2 for k in maps), [(k.name, len(k.grid)) for k in maps]
    _src, kernel = load_module(program)
    rng = np.random.default_rng(3)
    args = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s, _d in configs[1].dynamic]
    check_interpreted(_three_maps, kernel, args, atol=1e-4, rtol=1e-4)


def _add_row(buf, row, start):
    """One decode token's row added into a bf16 token buffer at a data-dependent position."""
    pos = jnp.minimum(start[0] + jnp.arange(1, dtype=jnp.int32), buf.shape[0] - 1)
    return buf.at[pos].add(row)


def test_a_bf16_row_scatter_kernel_compiles_for_the_tpu() -> None:
    """The one-hot form of a small row scatter selects bf16 rows with a mask broadcast along them; Mosaic
    cannot relayout such a mask for a 16-bit select ("Invalid relayout ... vector<1024x512xi1>"), so the
    kernel broadcasts it as int32 and selects in float32: it compiles, and it is exact."""
    configs = [
        Config(dynamic=[((1024, 512), "bfloat16"), ((1, 512), "bfloat16"), ((1,), "int32")], static=[]),
        Config(dynamic=[((256, 256), "bfloat16"), ((1, 256), "bfloat16"), ((1,), "int32")], static=[]),
    ]
    program = lower_program(trace_reference(_add_row, configs, ["buf", "row", "start"]), "t")
    _src, kernel = load_module(program)
    compiles(
        kernel, [(s, jnp.bfloat16 if d == "bfloat16" else jnp.int32) for s, d in configs[0].dynamic], ["v5e"]
    )
    rng = np.random.default_rng(4)
    buf = jnp.asarray(rng.standard_normal((256, 256)), jnp.bfloat16)
    row = jnp.asarray(rng.standard_normal((1, 256)), jnp.bfloat16)
    check_interpreted(_add_row, kernel, [buf, row, jnp.asarray([37], jnp.int32)], atol=0, rtol=0)
