"""RMSNorm over the hidden dimension with a learned scale, statistics in float32."""

import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        t, d = 32768, 4096
    else:
        t, d = 256, 1024
    k_x, k_w = jax.random.split(jax.random.key(14))
    x = (jax.random.normal(k_x, (t, d), jnp.float32) * 2.0 + 0.5).astype(dtype)
    weight = (1.0 + 0.1 * jax.random.normal(k_w, (d,), jnp.float32)).astype(dtype)
    return [x, weight], [1e-6]


def computation(x, weight, eps):
    xf = x.astype(jnp.float32)
    inv = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * inv * weight.astype(jnp.float32)).astype(x.dtype)
