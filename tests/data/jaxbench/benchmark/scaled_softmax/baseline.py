"""Scaled row softmax in the JAXBench workload format, with its own tolerances in CONFIG (maxkernel test)."""

import jax
import jax.numpy as jnp

CONFIG = dict(name="scaled_softmax", rows=1024, cols=512, scale=0.125, atol=5e-3, rtol=2e-3)


def create_inputs(dtype=jnp.float32):
    x = jax.random.normal(jax.random.PRNGKey(1), (CONFIG["rows"], CONFIG["cols"]), dtype=dtype)  # f32[r, c]
    return (x,)


def workload(x):
    return jax.nn.softmax(x * CONFIG["scale"], axis=-1)
