"""Decode-step paged attention (GQA): one query token per sequence attends to its KV cache,
which is scattered over fixed-size pages listed in a per-sequence page table; lengths mask the tail."""

import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        batch, heads, kv_heads, d, page_size, pages_per_seq, num_pages = 32, 32, 8, 128, 16, 256, 10240
    else:
        batch, heads, kv_heads, d, page_size, pages_per_seq, num_pages = 4, 4, 2, 128, 16, 8, 40
    ks = jax.random.split(jax.random.key(7), 5)
    q = jax.random.normal(ks[0], (batch, heads, d), jnp.float32).astype(dtype)
    k_pages = jax.random.normal(ks[1], (num_pages, page_size, kv_heads, d), jnp.float32).astype(dtype)
    v_pages = jax.random.normal(ks[2], (num_pages, page_size, kv_heads, d), jnp.float32).astype(dtype)
    # Every sequence owns distinct pages, drawn from the pool in random order.
    page_table = jax.random.permutation(ks[3], num_pages)[: batch * pages_per_seq]
    page_table = page_table.reshape(batch, pages_per_seq).astype(jnp.int32)
    lengths = jax.random.randint(ks[4], (batch,), 1, pages_per_seq * page_size + 1, jnp.int32)
    return [q, k_pages, v_pages, page_table, lengths], [float(d) ** -0.5]


def computation(q, k_pages, v_pages, page_table, lengths, sm_scale):
    batch, heads, d = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    max_len = page_table.shape[1] * page_size
    group = heads // kv_heads
    k = k_pages[page_table].reshape(batch, max_len, kv_heads, d)
    v = v_pages[page_table].reshape(batch, max_len, kv_heads, d)
    qg = q.reshape(batch, kv_heads, group, d)
    s = (
        jnp.einsum(
            "bhgd,blhd->bhgl", qg, k, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST
        )
        * sm_scale
    )
    valid = jnp.arange(max_len)[None, :] < lengths[:, None]  # [batch, max_len]
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhgl,blhd->bhgd", p, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return o.reshape(batch, heads, d).astype(q.dtype)
