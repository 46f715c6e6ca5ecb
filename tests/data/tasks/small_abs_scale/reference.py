"""2|x| + 1 of a matrix, a test task for honest kernels that use `//`, `%` and `jnp.sign` (tiny shapes)."""

import jax
import jax.numpy as jnp


def get_inputs(dtype=jnp.float32, scale="tpu"):
    shape = (64, 1024) if scale == "tpu" else (16, 256)
    return [jax.random.normal(jax.random.key(5), shape, dtype)], []


def computation(x):
    return 2.0 * jnp.abs(x) + 1.0
