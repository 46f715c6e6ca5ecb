"""Attention output projection + residual add + RMSNorm: rmsnorm(x @ w_o + residual) * gamma
(bfloat16 in/out, float32 statistics)."""

import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        t, k, d = 8192, 4096, 4096
    else:
        t, k, d = 256, 256, 256
    ks = jax.random.split(jax.random.key(121), 4)
    x = jax.random.normal(ks[0], (t, k), jnp.float32).astype(dtype)
    w_o = (jax.random.normal(ks[1], (k, d), jnp.float32) * k**-0.5).astype(dtype)
    residual = jax.random.normal(ks[2], (t, d), jnp.float32).astype(dtype)
    gamma = (1.0 + 0.2 * jax.random.normal(ks[3], (d,), jnp.float32)).astype(dtype)
    return [x, w_o, residual, gamma], [1e-6]


def computation(x, w_o, residual, gamma, eps):
    y = jnp.dot(x, w_o, preferred_element_type=jnp.float32) + residual.astype(jnp.float32)
    y = y * lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + eps)
    return (y * gamma.astype(jnp.float32)).astype(x.dtype)
