"""Inputs of 64 GiB: must be refused up front, never allocated."""

import jax
import jax.numpy as jnp


def get_inputs():
    return [jax.random.normal(jax.random.key(0), (131072, 131072), jnp.float32)], []


def computation(x):
    return x * 2
