"""Linear + bias, GroupNorm over groups of contiguous output features (per row), SiLU (float32)."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.float32, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        m, k, n, groups = 4096, 4096, 4096, 32
    else:
        m, k, n, groups = 128, 256, 512, 16
    k_x, k_w, k_b, k_g, k_be = jax.random.split(jax.random.key(109), 5)
    x = jax.random.normal(k_x, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(k_w, (k, n), jnp.float32) * k**-0.5).astype(dtype)
    b = (0.5 * jax.random.normal(k_b, (n,), jnp.float32)).astype(dtype)
    gamma = (1.0 + 0.2 * jax.random.normal(k_g, (n,), jnp.float32)).astype(dtype)
    beta = (0.2 * jax.random.normal(k_be, (n,), jnp.float32)).astype(dtype)
    return [x, w, b, gamma, beta], [groups, 1e-5]


def computation(x, w, b, gamma, beta, groups, eps):
    m, n = x.shape[0], w.shape[1]
    y = jnp.dot(x, w, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32) + b
    yg = y.reshape(m, groups, n // groups)
    mean = jnp.mean(yg, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(yg - mean), axis=-1, keepdims=True)
    y = ((yg - mean) * lax.rsqrt(var + eps)).reshape(m, n) * gamma + beta
    return jax.nn.silu(y).astype(x.dtype)
