"""Plain GEMM C = A @ B in bfloat16 with float32 accumulation."""

import jax.numpy as jnp


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        m, k, n = 8192, 8192, 8192
    else:
        m, k, n = 256, 512, 512
    k_a, k_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(k_a, (m, k), jnp.float32).astype(dtype)
    b = (jax.random.normal(k_b, (k, n), jnp.float32) * k**-0.5).astype(dtype)
    return [a, b], []


def computation(a, b):
    out = jnp.dot(a, b, preferred_element_type=jnp.float32)
    return out.astype(a.dtype)
