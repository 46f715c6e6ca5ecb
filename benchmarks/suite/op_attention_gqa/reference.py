"""Causal grouped-query attention: many query heads share each key/value head."""

import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        b, hq, hkv, s, d = 4, 32, 8, 4096, 128
    else:
        b, hq, hkv, s, d = 2, 4, 2, 256, 64
    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(kq, (b, hq, s, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, hkv, s, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, hkv, s, d), jnp.float32).astype(dtype)
    return [q, k, v], [float(d) ** -0.5]


def computation(q, k, v, sm_scale):
    b, hq, s_q, d = q.shape
    hkv, s_k = k.shape[1], k.shape[2]
    group = hq // hkv
    causal = jnp.arange(s_q)[:, None] >= jnp.arange(s_k)[None, :]
    qg = q.reshape(b, hkv, group, s_q, d)

    def one_batch(args):
        qb, kb, vb = args  # [hkv, group, s, d], [hkv, s, d], [hkv, s, d]
        s = (
            jnp.einsum(
                "hgqd,hkd->hgqk", qb, kb, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST
            )
            * sm_scale
        )
        s = jnp.where(causal, s, -jnp.inf)
        p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
        p = p / jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("hgqk,hkd->hgqd", p, vb.astype(jnp.float32), precision=lax.Precision.HIGHEST)
        return o.astype(q.dtype)

    out = lax.map(one_batch, (qg, k, v))
    return out.reshape(b, hq, s_q, d)
