"""A MaxKernel problem dir whose get_inputs computes a static value with jnp (maxkernel test): it must run
concretely, as the task's own harness runs it."""

import jax
import jax.numpy as jnp


def get_inputs(dtype=jnp.float32):
    head_dim = 128
    x = jax.random.normal(jax.random.key(0), (256, head_dim), dtype)
    scale = float(1.0 / jnp.sqrt(head_dim))
    return [x], [scale]


def computation(x, scale):
    return jax.nn.softmax(x * scale, axis=-1)
