"""Multi-scale retention (RetNet linear recurrence S_t = gamma_h S_{t-1} + k_t^T v_t, o_t = q_t S_t),
written in its parallel form o = ((q k^T / sqrt(d)) * D) v with D[n, m] = gamma_h^(n - m) for n >= m.
Per-head decays are gamma_h = 1 - 2^(-5 - h)."""

import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        b, h, s, d = 4, 16, 4096, 128
    else:
        b, h, s, d = 2, 4, 256, 64
    kq, kk, kv = jax.random.split(jax.random.key(18), 3)
    q = jax.random.normal(kq, (b, h, s, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, h, s, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, h, s, d), jnp.float32).astype(dtype)
    return [q, k, v], []


def computation(q, k, v):
    _, h, s, d = q.shape
    log_gamma = jnp.log1p(-jnp.exp2(-5.0 - jnp.arange(h, dtype=jnp.float32)))  # [h]
    pos = jnp.arange(s)
    diff = (pos[:, None] - pos[None, :]).astype(jnp.float32)
    decay = jnp.where(diff >= 0, jnp.exp(jnp.maximum(diff, 0.0)[None] * log_gamma[:, None, None]), 0.0)

    def one_batch(args):
        qb, kb, vb = args  # [h, s, d]
        sc = jnp.einsum(
            "hqd,hkd->hqk", qb, kb, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST
        ) * (d**-0.5)
        o = jnp.einsum("hqk,hkd->hqd", sc * decay, vb.astype(jnp.float32), precision=lax.Precision.HIGHEST)
        return o.astype(q.dtype)

    return lax.map(one_batch, (q, k, v))
