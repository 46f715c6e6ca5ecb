"""Linear (no bias), training-mode BatchNorm over the batch rows (biased variance), ReLU (float32)."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.float32, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        m, k, n = 8192, 4096, 2048
    else:
        m, k, n = 256, 256, 256
    k_x, k_w, k_g, k_b = jax.random.split(jax.random.key(108), 4)
    x = jax.random.normal(k_x, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(k_w, (k, n), jnp.float32) * k**-0.5).astype(dtype)
    gamma = (1.0 + 0.2 * jax.random.normal(k_g, (n,), jnp.float32)).astype(dtype)
    beta = (0.2 * jax.random.normal(k_b, (n,), jnp.float32)).astype(dtype)
    return [x, w, gamma, beta], [1e-5]


def computation(x, w, gamma, beta, eps):
    y = jnp.dot(x, w, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    mean = jnp.mean(y, axis=0, keepdims=True)
    var = jnp.mean(jnp.square(y - mean), axis=0, keepdims=True)
    y = (y - mean) * lax.rsqrt(var + eps) * gamma + beta
    return jax.nn.relu(y).astype(x.dtype)
