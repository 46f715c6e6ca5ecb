"""x @ w, hard-tanh (clip to [-1, 1]), exact GELU, inverted dropout with a fixed key (float32)."""

import jax
import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.float32, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        m, k, n = 8192, 2048, 4096
    else:
        m, k, n = 256, 256, 512
    k_x, k_w = jax.random.split(jax.random.key(123))
    x = jax.random.normal(k_x, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(k_w, (k, n), jnp.float32) * k**-0.5).astype(dtype)
    return [x, w], [0.2, 7]


def computation(x, w, rate, seed):
    y = jnp.dot(x, w, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    y = jax.nn.gelu(jnp.clip(y, -1.0, 1.0), approximate=False)
    keep = jax.random.bernoulli(jax.random.key(seed), 1.0 - rate, y.shape)
    return jnp.where(keep, y / (1.0 - rate), 0.0).astype(x.dtype)
