"""Causal multi-head softmax attention, q/k/v laid out [batch, heads, seq, head_dim]."""

import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        b, h, s, d = 8, 16, 4096, 128
    else:
        b, h, s, d = 2, 4, 256, 128
    kq, kk, kv = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(kq, (b, h, s, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, h, s, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, h, s, d), jnp.float32).astype(dtype)
    return [q, k, v], [float(d) ** -0.5]


def computation(q, k, v, sm_scale):
    s_q, s_k = q.shape[2], k.shape[2]
    causal = jnp.arange(s_q)[:, None] >= jnp.arange(s_k)[None, :]

    def one_batch(args):
        qb, kb, vb = args
        s = (
            jnp.einsum(
                "hqd,hkd->hqk", qb, kb, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST
            )
            * sm_scale
        )
        s = jnp.where(causal, s, -jnp.inf)
        p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
        p = p / jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("hqk,hkd->hqd", p, vb.astype(jnp.float32), precision=lax.Precision.HIGHEST)
        return o.astype(q.dtype)

    # One batch element at a time keeps the [heads, seq, seq] score matrix affordable at TPU scale.
    return lax.map(one_batch, (q, k, v))
