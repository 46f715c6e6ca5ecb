"""tanh-GELU of a matrix: an elementwise task (bare reference.py, no yaml)."""

import jax
import jax.numpy as jnp


def get_inputs(dtype=jnp.float32):
    return [jax.random.normal(jax.random.key(3), (256, 512), dtype)], []


def computation(x):
    return jax.nn.gelu(x, approximate=True)
