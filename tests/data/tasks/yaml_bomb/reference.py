"""A task whose kernel_task.yaml is an alias bomb: it must be refused, not expanded."""

import jax.numpy as jnp


def get_inputs(dtype=jnp.float32):
    return [jnp.ones((8, 128), dtype)], []


def computation(x):
    return x * 2
