"""relu(x @ w + b) at test size."""

import jax
import jax.numpy as jnp


def get_inputs(dtype=jnp.float32, scale="tpu"):
    m, k, n = (1024, 2048, 1024) if scale == "tpu" else (128, 256, 256)
    kx, kw, kb = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), dtype)
    w = jax.random.normal(kw, (k, n), dtype) / jnp.sqrt(k).astype(dtype)
    b = jax.random.normal(kb, (n,), dtype)
    return [x, w, b], []


def computation(x, w, b):
    return jax.nn.relu(jnp.dot(x, w, preferred_element_type=jnp.float32) + b).astype(x.dtype)
