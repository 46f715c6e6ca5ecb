"""Linear + bias, inverted dropout with a fixed key (jax.random.bernoulli on key(seed)), ReLU."""

import jax
import jax.numpy as jnp


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        m, k, n = 8192, 4096, 4096
    else:
        m, k, n = 256, 256, 512
    k_x, k_w, k_b = jax.random.split(jax.random.key(111), 3)
    x = jax.random.normal(k_x, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(k_w, (k, n), jnp.float32) * k**-0.5).astype(dtype)
    b = (0.5 * jax.random.normal(k_b, (n,), jnp.float32)).astype(dtype)
    return [x, w, b], [0.1, 1234]


def computation(x, w, b, rate, seed):
    y = jnp.dot(x, w, preferred_element_type=jnp.float32) + b.astype(jnp.float32)
    keep = jax.random.bernoulli(jax.random.key(seed), 1.0 - rate, y.shape)
    y = jnp.where(keep, y / (1.0 - rate), 0.0)
    return jax.nn.relu(y).astype(x.dtype)
