"""x @ w, exact GELU, softmax over the output features (float32)."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.float32, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        m, k, n = 4096, 4096, 8192
    else:
        m, k, n = 128, 256, 512
    k_x, k_w = jax.random.split(jax.random.key(119))
    x = jax.random.normal(k_x, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(k_w, (k, n), jnp.float32) * 2.0 * k**-0.5).astype(dtype)
    return [x, w], []


def computation(x, w):
    y = jnp.dot(x, w, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    y = jax.nn.gelu(y, approximate=False)
    e = jnp.exp(y - jnp.max(y, axis=-1, keepdims=True))
    return (e / jnp.sum(e, axis=-1, keepdims=True)).astype(x.dtype)
