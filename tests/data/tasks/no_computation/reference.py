import jax.numpy as jnp


def get_inputs():
    return [jnp.ones((8, 128))], []


def compute(x):
    return x
