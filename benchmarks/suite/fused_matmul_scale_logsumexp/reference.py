"""Row-wise logsumexp of scale * (x @ w) -> one float32 value per row."""

import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.float32, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        m, k, n = 8192, 4096, 4096
    else:
        m, k, n = 256, 256, 512
    k_x, k_w = jax.random.split(jax.random.key(106))
    x = jax.random.normal(k_x, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(k_w, (k, n), jnp.float32) * k**-0.5).astype(dtype)
    return [x, w], [2.0]


def computation(x, w, scale):
    y = scale * jnp.dot(x, w, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    m = jnp.max(y, axis=-1, keepdims=True)
    return (jnp.log(jnp.sum(jnp.exp(y - m), axis=-1)) + m[:, 0]).astype(x.dtype)
