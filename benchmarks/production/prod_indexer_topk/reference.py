"""The sparse-attention indexer of DeepSeek-V3.2/V4 (the "lightning indexer"): every query scores every
earlier cache position as a weighted sum over indexer heads of ReLU(q_h . k) (one shared 128-dim key per
position, 64 heads with a per-query weight each), and keeps the top K. Returned: each query's K best
scores, in descending order, 0 where fewer than K positions exist. (The positions themselves are not
returned: near-equal scores swap places under any change of summation order, so an index output would
compare rounding, not the selection.) Shapes after DeepSeek's published configuration: 64 indexer heads
of dim 128, top-k 2048; a 2048-query prefill chunk at the end of an 8192-position context."""

import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        b, s, h, d, skv, k = 1, 2048, 64, 128, 8192, 2048
    else:
        b, s, h, d, skv, k = 1, 64, 8, 128, 256, 96
    kq, kk, kw = jax.random.split(jax.random.key(303), 3)
    q = jax.random.normal(kq, (b, s, h, d), jnp.float32).astype(dtype)
    key = jax.random.normal(kk, (b, skv, d), jnp.float32).astype(dtype)
    weights = jax.random.uniform(kw, (b, s, h), jnp.float32) * h**-0.5
    return [q, key, weights], [k]


def computation(q, key, weights, top_k):
    s, skv = q.shape[1], key.shape[1]
    per_head = jnp.einsum("bshd,btd->bsht", q, key, preferred_element_type=jnp.float32)
    score = jnp.einsum("bsht,bsh->bst", jnp.maximum(per_head, 0.0), weights)
    pos = skv - s + jnp.arange(s)  # the queries are the last s positions
    causal = jnp.arange(skv)[None, :] <= pos[:, None]
    score = jnp.where(causal[None], score, -jnp.inf)
    best, _ = lax.top_k(score, top_k)
    return jnp.where(jnp.isfinite(best), best, 0.0)
