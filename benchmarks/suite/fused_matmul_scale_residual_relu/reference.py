"""relu(scale * (x @ w) + residual) in float32."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.float32, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        m, k, n = 4096, 4096, 4096
    else:
        m, k, n = 128, 256, 256
    k_x, k_w, k_r = jax.random.split(jax.random.key(101), 3)
    x = jax.random.normal(k_x, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(k_w, (k, n), jnp.float32) * k**-0.5).astype(dtype)
    residual = jax.random.normal(k_r, (m, n), jnp.float32).astype(dtype)
    return [x, w, residual], [0.5]


def computation(x, w, residual, scale):
    y = jnp.dot(x, w, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return jax.nn.relu(scale * y + residual.astype(jnp.float32)).astype(x.dtype)
