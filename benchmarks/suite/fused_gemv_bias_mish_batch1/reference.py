"""Batch-of-one linear layer (GEMV, memory bound) + bias + mish; N is not a multiple of 128 at CPU
scale (1000)."""

import jax
import jax.numpy as jnp


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        k, n = 8192, 28672
    else:
        k, n = 512, 1000
    k_x, k_w, k_b = jax.random.split(jax.random.key(117), 3)
    x = jax.random.normal(k_x, (1, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(k_w, (k, n), jnp.float32) * k**-0.5).astype(dtype)
    b = (0.5 * jax.random.normal(k_b, (n,), jnp.float32)).astype(dtype)
    return [x, w, b], []


def computation(x, w, b):
    y = jnp.dot(x, w, preferred_element_type=jnp.float32) + b.astype(jnp.float32)
    return (y * jnp.tanh(jax.nn.softplus(y))).astype(x.dtype)
