"""Linear + bias, sigmoid, then sum over the batch rows (a column reduction) -> [N] (float32)."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.float32, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        m, k, n = 8192, 4096, 4096
    else:
        m, k, n = 256, 256, 512
    k_x, k_w, k_b = jax.random.split(jax.random.key(122), 3)
    x = jax.random.normal(k_x, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(k_w, (k, n), jnp.float32) * k**-0.5).astype(dtype)
    b = jax.random.normal(k_b, (n,), jnp.float32).astype(dtype)
    return [x, w, b], []


def computation(x, w, b):
    y = jnp.dot(x, w, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32) + b
    return jnp.sum(jax.nn.sigmoid(y), axis=0).astype(x.dtype)
