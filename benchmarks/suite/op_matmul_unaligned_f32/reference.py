"""Float32 matmul whose dimensions are not multiples of 128 (kernels must pad or mask)."""

import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.float32, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        m, k, n = 4000, 5000, 10000
    else:
        m, k, n = 250, 300, 1000
    k_a, k_b = jax.random.split(jax.random.key(1))
    a = jax.random.normal(k_a, (m, k), jnp.float32).astype(dtype)
    b = (jax.random.normal(k_b, (k, n), jnp.float32) * k**-0.5).astype(dtype)
    return [a, b], []


def computation(a, b):
    out = jnp.dot(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(a.dtype)
