"""LayerNorm with affine parameters over a hidden size that is not a multiple of 128
(Falcon-7B's 4544 on TPU, 568 on CPU)."""

import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.float32, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        t, d = 16384, 4544
    else:
        t, d = 128, 568
    k_x, k_g, k_b = jax.random.split(jax.random.key(15), 3)
    x = (jax.random.normal(k_x, (t, d), jnp.float32) * 3.0 - 1.0).astype(dtype)
    gamma = (1.0 + 0.1 * jax.random.normal(k_g, (d,), jnp.float32)).astype(dtype)
    beta = (0.1 * jax.random.normal(k_b, (d,), jnp.float32)).astype(dtype)
    return [x, gamma, beta], [1e-5]


def computation(x, gamma, beta, eps):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * lax.rsqrt(var + eps)
    return (y * gamma.astype(jnp.float32) + beta.astype(jnp.float32)).astype(x.dtype)
