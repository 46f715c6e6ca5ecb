"""Paged K/V straight from the pool (`paged.py`): a paged-attention reference (`k_pages[page_table]`)
becomes one kernel that scalar-prefetches the page table and fetches each page through its own index map,
with no gathered copy of the cache left in XLA. Correct in TPU interpret mode on odd shapes (group of 3,
5 pages per sequence, lengths of 1 and of the whole table), compiles for v5e and v6e ahead of time, and the
block model counts exactly the pages a sequence's length keeps live."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.base import TileConfig
from maxkernel.authors.offline.author import checked_source
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.partition import Options
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.estimate import estimate_pallas
from tests.offline_helpers import check_interpreted, compiles

TPU = ["v5e", "v6e"]
NAMES = ["q", "k_pages", "v_pages", "page_table", "lengths", "sm_scale"]


def paged_decode(q, k_pages, v_pages, page_table, lengths, sm_scale):
    """One query token per sequence over its paged KV cache (grouped-query heads), lengths masking."""
    batch, heads, d = q.shape
    _, page, kv_heads, _ = k_pages.shape
    max_len = page_table.shape[1] * page
    k = k_pages[page_table].reshape(batch, max_len, kv_heads, d)
    v = v_pages[page_table].reshape(batch, max_len, kv_heads, d)
    qg = q.reshape(batch, kv_heads, heads // kv_heads, d)
    s = jnp.einsum("bhgd,blhd->bhgl", qg, k, preferred_element_type=jnp.float32) * sm_scale
    valid = jnp.arange(max_len)[None, :] < lengths[:, None]
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhgl,blhd->bhgd", p, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return o.reshape(batch, heads, d).astype(q.dtype)


def shapes(batch: int, kv_heads: int, group: int, pages: int, n_pages: int, page: int = 16, d: int = 128):
    return [
        ((batch, kv_heads * group, d), "bfloat16"),
        ((n_pages, page, kv_heads, d), "bfloat16"),
        ((n_pages, page, kv_heads, d), "bfloat16"),
        ((batch, pages), "int32"),
        ((batch,), "int32"),
    ]


def inputs(rng: np.random.Generator, batch: int, kv_heads: int, group: int, pages: int, n_pages: int):
    page, d = 16, 128
    q = jnp.asarray(rng.standard_normal((batch, kv_heads * group, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((n_pages, page, kv_heads, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((n_pages, page, kv_heads, d)), jnp.bfloat16)
    table = rng.permutation(n_pages)[: batch * pages].reshape(batch, pages).astype(np.int32)
    lengths = rng.integers(1, pages * page + 1, batch).astype(np.int32)
    lengths[0], lengths[-1] = 1, pages * page  # one key only; the whole table
    return [q, k, v, jnp.asarray(table), jnp.asarray(lengths)]


CONFIGS = [(3, 2, 3, 5, 23), (2, 2, 3, 7, 17)]  # batch, kv heads, group, pages per sequence, pool pages


def program(options: Options | None = None):
    configs = [Config(dynamic=shapes(*c), static=[0.125]) for c in CONFIGS]
    return lower_program(trace_reference(paged_decode, configs, NAMES), "t", options)


def load(prog, block_kv: int | None = None):
    """The module at the author's default tiles, or with `block_kv` keys (whole pages) per grid step."""
    config = default_config(prog, TPU)
    if block_kv is not None:
        config = TileConfig(params=tuple((n, block_kv if n == "block_kv" else v) for n, v in config.params))
    src = checked_source(prog, config, TPU)
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    return src, ns["computation"]


@pytest.fixture(scope="module")
def paged():
    return load(program())


def test_paged_kv_is_read_from_the_pool_and_correct() -> None:
    # 4 pages per key block: 5 and 7 pages per sequence take two blocks (the second partly padded), so
    # the online softmax, the length clamp and the padded table all run; fewer page operands than the
    # default block keep TPU interpret mode fast
    src, kernel = load(program(), block_kv=64)
    assert "lax.gather" not in src  # no gathered copy of the cache in XLA
    assert "_page_index_map" in src and "PrefetchScalarGridSpec" in src
    rng = np.random.default_rng(5)
    for c in CONFIGS[:1]:  # the other configuration only fixes the shapes the author generalises over
        args = inputs(rng, *c)
        check_interpreted(
            lambda *a: paged_decode(*a, 0.125), lambda *a: kernel(*a, 0.125), args, atol=2e-2, rtol=2e-2
        )


def paged_decode_mha(q, k_pages, v_pages, page_table, lengths, sm_scale):
    """One query head per K/V head and no length mask (every key of the table counts): the pages are read
    through a plain grid (no length clamp) and no group rides in the query block."""
    batch, heads, d = q.shape
    _, page, kv_heads, _ = k_pages.shape
    max_len = page_table.shape[1] * page
    k = k_pages[page_table].reshape(batch, max_len, kv_heads, d)
    v = v_pages[page_table].reshape(batch, max_len, kv_heads, d)
    p = jax.nn.softmax(
        jnp.einsum("bhd,blhd->bhl", q, k, preferred_element_type=jnp.float32) * sm_scale, axis=-1
    )
    o = jnp.einsum("bhl,blhd->bhd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.astype(q.dtype) + 0 * lengths[:, None, None].astype(q.dtype)


def test_paged_kv_without_lengths_or_groups_is_correct() -> None:
    configs = [Config(dynamic=shapes(b, h, 1, p, n), static=[0.125]) for b, h, _, p, n in CONFIGS]
    src, kernel = load(lower_program(trace_reference(paged_decode_mha, configs, NAMES), "t"), block_kv=64)
    assert "lax.gather" not in src and "_page_index_map" in src
    args = inputs(np.random.default_rng(8), 3, 2, 1, 5, 23)
    check_interpreted(
        lambda *a: paged_decode_mha(*a, 0.125), lambda *a: kernel(*a, 0.125), args, atol=2e-2, rtol=2e-2
    )


def test_without_paging_the_gather_stays_glue_and_is_correct() -> None:
    src, kernel = load(program(Options(paged=False)))
    assert "lax.gather" in src and "_page_index_map" not in src
    args = inputs(np.random.default_rng(6), *CONFIGS[0])
    check_interpreted(
        lambda *a: paged_decode(*a, 0.125), lambda *a: kernel(*a, 0.125), args, atol=2e-2, rtol=2e-2
    )


def test_paged_kernel_compiles_for_v5e_and_v6e(paged) -> None:
    _, kernel = paged
    specs = [(s, jnp.dtype(d)) for s, d in shapes(8, 4, 4, 64, 600)]
    compiles(lambda *a: kernel(*a, 0.125), specs, TPU)


def test_block_model_counts_the_live_pages_only(paged) -> None:
    """Each page operand is copied once per live key block of a sequence; blocks past its length keep the
    last live block's page ids (no copy), and nothing outside the kernel moves the cache."""
    _, kernel = paged
    rng = np.random.default_rng(7)
    batch, kv_heads, group, pages, n_pages = 8, 4, 4, 64, 600
    args = inputs(rng, batch, kv_heads, group, pages, n_pages)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    jaxpr = jax.make_jaxpr(lambda *a: kernel(*a, 0.125))(*specs)
    est = estimate_pallas(jaxpr, "v5e", {3: np.asarray(args[3]), 4: np.asarray(args[4])})
    (pc,) = est.pallas_calls
    page_bytes = 16 * kv_heads * 128 * 2
    page_ops = [o for o in pc.operands if o.role == "input" and o.block_bytes == page_bytes]
    per_block = len(page_ops) // 2  # K and V
    bkv = per_block * 16
    live_blocks = sum(math.ceil(int(n) / bkv) for n in np.asarray(args[4]))
    assert all(o.index_map_exact for o in page_ops)
    assert sum(o.est_transfers for o in page_ops) == 2 * per_block * live_blocks
    assert est.est_xla_bytes < page_bytes * batch  # only the tables and small glue outside the kernel
