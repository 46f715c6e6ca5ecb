"""Row scaling in the JAXBench workload format (maxkernel test); its optimized.py hard-codes the real shape."""

import jax
import jax.numpy as jnp

CONFIG = {"name": "row_scale", "M": 1536, "N": 256, "atol": 1e-3}


def create_inputs(dtype=jnp.float32):
    kx, ks = jax.random.split(jax.random.PRNGKey(2))
    x = jax.random.normal(kx, (CONFIG["M"], CONFIG["N"]), dtype=dtype)  # f32[m, n]
    s = jax.random.uniform(ks, (CONFIG["M"], 1), dtype=dtype)  # f32[m, 1]
    return x, s


def workload(x, s):
    return x * s
