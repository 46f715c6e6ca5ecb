"""tanh(mish(x @ w)) with mish(y) = y * tanh(softplus(y)) (float32)."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.float32, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        m, k, n = 4096, 8192, 4096
    else:
        m, k, n = 128, 512, 256
    k_x, k_w = jax.random.split(jax.random.key(103))
    x = jax.random.normal(k_x, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(k_w, (k, n), jnp.float32) * k**-0.5).astype(dtype)
    return [x, w], []


def computation(x, w):
    y = jnp.dot(x, w, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    y = y * jnp.tanh(jax.nn.softplus(y))
    return jnp.tanh(y).astype(x.dtype)
