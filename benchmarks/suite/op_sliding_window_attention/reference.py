"""Causal sliding-window attention: query i attends to keys j with i - window < j <= i."""

import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        b, h, s, d, window = 2, 32, 8192, 128, 1024
    else:
        b, h, s, d, window = 1, 4, 256, 64, 64
    kq, kk, kv = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(kq, (b, h, s, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, h, s, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, h, s, d), jnp.float32).astype(dtype)
    return [q, k, v], [window, float(d) ** -0.5]


def computation(q, k, v, window, sm_scale):
    b, h, s_q, d = q.shape
    s_k = k.shape[2]
    qi = jnp.arange(s_q)[:, None]
    kj = jnp.arange(s_k)[None, :]
    allowed = (kj <= qi) & (kj > qi - window)

    def one_head(args):
        qh, kh, vh = args  # [s, d] each
        s = jnp.dot(qh, kh.T, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST) * sm_scale
        s = jnp.where(allowed, s, -jnp.inf)
        p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
        p = p / jnp.sum(p, axis=-1, keepdims=True)
        return jnp.dot(p, vh.astype(jnp.float32), precision=lax.Precision.HIGHEST).astype(q.dtype)

    out = lax.map(one_head, (q.reshape(b * h, s_q, d), k.reshape(b * h, s_k, d), v.reshape(b * h, s_k, d)))
    return out.reshape(b, h, s_q, d)
