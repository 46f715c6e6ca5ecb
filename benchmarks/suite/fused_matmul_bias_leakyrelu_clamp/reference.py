"""Linear + bias, leaky ReLU, then clamp to [clamp_min, clamp_max] (float32)."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.float32, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        m, k, n = 8192, 2048, 4096
    else:
        m, k, n = 256, 256, 512
    k_x, k_w, k_b = jax.random.split(jax.random.key(102), 3)
    x = jax.random.normal(k_x, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(k_w, (k, n), jnp.float32) * k**-0.5).astype(dtype)
    b = (0.5 * jax.random.normal(k_b, (n,), jnp.float32)).astype(dtype)
    return [x, w, b], [0.01, -0.02, 1.5]


def computation(x, w, b, negative_slope, clamp_min, clamp_max):
    y = jnp.dot(x, w, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    y = jax.nn.leaky_relu(y + b.astype(jnp.float32), negative_slope)
    return jnp.clip(y, clamp_min, clamp_max).astype(x.dtype)
