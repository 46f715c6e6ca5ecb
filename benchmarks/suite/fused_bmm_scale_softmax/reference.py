"""Batched matmul a[b] @ c[b], scaled, softmax over the last axis (bfloat16 in/out)."""

import jax.numpy as jnp


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        b, m, k, n = 64, 2048, 512, 2048
    else:
        b, m, k, n = 4, 128, 128, 256
    k_a, k_c = jax.random.split(jax.random.key(114))
    a = jax.random.normal(k_a, (b, m, k), jnp.float32).astype(dtype)
    c = jax.random.normal(k_c, (b, k, n), jnp.float32).astype(dtype)
    return [a, c], [float(k) ** -0.5]


def computation(a, c, scale):
    s = jnp.einsum("bmk,bkn->bmn", a, c, preferred_element_type=jnp.float32) * scale
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    return (e / jnp.sum(e, axis=-1, keepdims=True)).astype(a.dtype)
