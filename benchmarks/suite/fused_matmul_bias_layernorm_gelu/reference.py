"""Linear + bias, LayerNorm over features, exact GELU (bfloat16 in/out, float32 math)."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        m, k, n = 8192, 4096, 4096
    else:
        m, k, n = 256, 256, 512
    k_x, k_w, k_b, k_g, k_be = jax.random.split(jax.random.key(110), 5)
    x = jax.random.normal(k_x, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(k_w, (k, n), jnp.float32) * k**-0.5).astype(dtype)
    b = (0.5 * jax.random.normal(k_b, (n,), jnp.float32)).astype(dtype)
    gamma = (1.0 + 0.2 * jax.random.normal(k_g, (n,), jnp.float32)).astype(dtype)
    beta = (0.2 * jax.random.normal(k_be, (n,), jnp.float32)).astype(dtype)
    return [x, w, b, gamma, beta], [1e-5]


def computation(x, w, b, gamma, beta, eps):
    f32 = jnp.float32
    y = jnp.dot(x, w, preferred_element_type=f32) + b.astype(f32)
    mean = jnp.mean(y, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(y - mean), axis=-1, keepdims=True)
    y = (y - mean) * lax.rsqrt(var + eps) * gamma.astype(f32) + beta.astype(f32)
    return jax.nn.gelu(y, approximate=False).astype(x.dtype)
