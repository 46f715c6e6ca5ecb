"""Attention as people write it in plain JAX is still flash attention in the offline author:

- `jax.nn.softmax` on bf16 scores sums the exponentials after a cast to float32, so the row sum reads a cast
  of `exp`, not `exp` itself (before, such attention became a matmul that wrote the whole [B, H, S, S]
  score array to HBM, then a second matmul; at long sequences it did not fit in HBM);
- grouped-query attention that repeats each K/V head for its query heads (`jnp.repeat` on a new axis, then
  a reshape): the repeat is layout on the inputs and runs outside kernels (before: "a value is needed
  outside kernels but never written").

Each case is checked in TPU interpret mode at two shapes and compiled with Mosaic for v5e and v6e at a
production shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from offline_helpers import check_on_normal_inputs, compiles_at, load_module

from maxkernel.authors.base import TileConfig
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.trace import Config, trace_reference


def causal_softmax_attention(q, k, v):
    n = q.shape[2]
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1])
    keep = jnp.tril(jnp.ones((n, n), q.dtype))
    s = jnp.where(keep, s, -1e30)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def repeated_kv_attention(q, k, v):
    b, n, hq, d = q.shape
    rep = hq // k.shape[2]
    k = jnp.repeat(k[:, :, :, None, :], rep, axis=3).reshape(b, n, hq, d)
    v = jnp.repeat(v[:, :, :, None, :], rep, axis=3).reshape(b, n, hq, d)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * d**-0.5
    row = jnp.arange(n)[:, None]
    s = jnp.where(row >= jnp.arange(n)[None, :], s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def split_heads_decode(q, k, v):
    """One query token per sequence, its heads written as (K/V head, group) by hand: the score dot's query
    side has one non-unit free dim (the group), as the key side has (the keys)."""
    b, hq, d = q.shape
    hkv = k.shape[2]
    qs = q.reshape(b, 1, hkv, hq // hkv, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qs, k, preferred_element_type=jnp.float32) * d**-0.5
    o = jnp.einsum("bhgqk,bkhd->bqhgd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)
    return o.reshape(b, hq, d)


CASES = {
    "causal_softmax": (
        causal_softmax_attention,
        [[(1, 2, 256, 128)] * 3, [(2, 1, 384, 128)] * 3],
        [[(2, 16, 4096, 128)] * 3],
    ),
    "repeated_kv": (
        repeated_kv_attention,
        [
            [(1, 256, 4, 128), (1, 256, 2, 128), (1, 256, 2, 128)],
            [(2, 128, 8, 128), (2, 128, 2, 128), (2, 128, 2, 128)],
        ],
        [[(2, 2048, 32, 128), (2, 2048, 4, 128), (2, 2048, 4, 128)]],
    ),
    "split_heads_decode": (
        split_heads_decode,
        [
            [(2, 8, 128), (2, 256, 2, 128), (2, 256, 2, 128)],
            [(1, 4, 128), (1, 384, 1, 128), (1, 384, 1, 128)],
        ],
        [[(16, 32, 128), (16, 4096, 8, 128), (16, 4096, 8, 128)]],
    ),
}


def test_plain_jax_attention_forms_are_flash_attention() -> None:
    rng = np.random.default_rng(8)
    for name, (fn, shapes, production) in CASES.items():
        configs = [Config(dynamic=[(s, "bfloat16") for s in case], static=[]) for case in shapes]
        program = lower_program(trace_reference(fn, configs, ["q", "k", "v"]), "t")
        assert [k.name for k in program.kernels] == ["_attention"], (name, [k.name for k in program.kernels])
        _, kernel = load_module(program)
        check_on_normal_inputs(fn, kernel, shapes, jnp.bfloat16, rng, scale=1.0, atol=2e-2, rtol=2e-2)
        compiles_at(kernel, production, jnp.bfloat16)


def finite_fill_attention(q, k, v, lag=0):
    """Causal attention (shifted by `lag` keys) masked with a finite fill, as many models write it."""
    n = q.shape[2]
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1])
    keep = jnp.arange(n)[:, None] - lag >= jnp.arange(n)[None, :]
    s = jnp.where(keep, s, -1e9)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(v.dtype), v)


def test_a_finite_mask_fill_still_skips_dead_key_blocks() -> None:
    """A -1e9 fill underflows exp to exactly 0 beside any live key, so dead key blocks are skipped as with
    -inf; rows with no live key at all (the first `lag` rows here) average every key in the reference, so
    their q blocks keep every key block and stay exact."""
    rng = np.random.default_rng(9)
    shapes = [[(1, 2, 512, 128)] * 3, [(2, 1, 384, 128)] * 3]
    for lag in (0, 200):

        def fn(q, k, v, lag=lag):
            return finite_fill_attention(q, k, v, lag)

        configs = [Config(dynamic=[(s, "bfloat16") for s in case], static=[]) for case in shapes]
        program = lower_program(trace_reference(fn, configs, ["q", "k", "v"]), "t")
        assert [k.name for k in program.kernels] == ["_attention"]
        source, kernel = load_module(program, TileConfig.of(block_q=128, block_kv=128))
        assert "_schedule(" in source, "the finite fill did not give the block schedule"
        check_on_normal_inputs(fn, kernel, shapes, jnp.bfloat16, rng, scale=1.0, atol=2e-2, rtol=2e-2)
