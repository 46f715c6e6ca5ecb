"""Batched matmul a[b] @ w[b], add a residual, LayerNorm over the last axis (bfloat16 in/out)."""

import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        b, m, k, n = 16, 2048, 2048, 1024
    else:
        b, m, k, n = 2, 128, 256, 256
    ks = jax.random.split(jax.random.key(115), 5)
    a = jax.random.normal(ks[0], (b, m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(ks[1], (b, k, n), jnp.float32) * k**-0.5).astype(dtype)
    residual = jax.random.normal(ks[2], (b, m, n), jnp.float32).astype(dtype)
    gamma = (1.0 + 0.2 * jax.random.normal(ks[3], (n,), jnp.float32)).astype(dtype)
    beta = (0.2 * jax.random.normal(ks[4], (n,), jnp.float32)).astype(dtype)
    return [a, w, residual, gamma, beta], [1e-5]


def computation(a, w, residual, gamma, beta, eps):
    f32 = jnp.float32
    y = jnp.einsum("bmk,bkn->bmn", a, w, preferred_element_type=f32) + residual.astype(f32)
    mean = jnp.mean(y, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(y - mean), axis=-1, keepdims=True)
    y = (y - mean) * lax.rsqrt(var + eps) * gamma.astype(f32) + beta.astype(f32)
    return y.astype(a.dtype)
