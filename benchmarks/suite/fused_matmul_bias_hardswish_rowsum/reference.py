"""Linear + bias, hard-swish, then sum over the feature axis -> one float32 value per row."""

import jax
import jax.numpy as jnp


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        m, k, n = 8192, 4096, 8192
    else:
        m, k, n = 256, 256, 512
    k_x, k_w, k_b = jax.random.split(jax.random.key(104), 3)
    x = jax.random.normal(k_x, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(k_w, (k, n), jnp.float32) * k**-0.5).astype(dtype)
    b = (0.5 * jax.random.normal(k_b, (n,), jnp.float32)).astype(dtype)
    return [x, w, b], []


def computation(x, w, b):
    y = jnp.dot(x, w, preferred_element_type=jnp.float32) + b.astype(jnp.float32)
    return jnp.sum(jax.nn.hard_swish(y), axis=-1)
