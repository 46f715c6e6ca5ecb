"""Batched matmul a[b] @ c[b], tanh, then max over the M (row) axis -> [batch, N] (float32)."""

import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.float32, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        b, m, k, n = 32, 2048, 1024, 1024
    else:
        b, m, k, n = 4, 128, 128, 128
    k_a, k_c = jax.random.split(jax.random.key(116))
    a = jax.random.normal(k_a, (b, m, k), jnp.float32).astype(dtype)
    c = (jax.random.normal(k_c, (b, k, n), jnp.float32) * 0.5 * k**-0.5).astype(dtype)
    return [a, c], []


def computation(a, c):
    y = jnp.einsum("bmk,bkn->bmn", a, c, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return jnp.max(jnp.tanh(y), axis=1).astype(a.dtype)
