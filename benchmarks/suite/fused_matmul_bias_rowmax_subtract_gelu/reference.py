"""Linear + bias, subtract each row's maximum, then exact GELU (bfloat16 in/out)."""

import jax
import jax.numpy as jnp


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        m, k, n = 16384, 2048, 4096
    else:
        m, k, n = 256, 256, 512
    k_x, k_w, k_b = jax.random.split(jax.random.key(107), 3)
    x = jax.random.normal(k_x, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(k_w, (k, n), jnp.float32) * k**-0.5).astype(dtype)
    b = (0.5 * jax.random.normal(k_b, (n,), jnp.float32)).astype(dtype)
    return [x, w, b], []


def computation(x, w, b):
    y = jnp.dot(x, w, preferred_element_type=jnp.float32) + b.astype(jnp.float32)
    y = y - jnp.max(y, axis=-1, keepdims=True)
    return jax.nn.gelu(y, approximate=False).astype(x.dtype)
