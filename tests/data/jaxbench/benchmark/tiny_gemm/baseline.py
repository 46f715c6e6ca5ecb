"""A small GEMM in the JAXBench workload format (written for maxkernel's tests, not taken from JAXBench).

CONFIG sets no tolerances, so JAXBench's default (atol = rtol = 1e-2) applies.
"""

import jax
import jax.numpy as jnp

CONFIG = {
    "name": "tiny_gemm",
    "M": 1536,
    "K": 256,
    "N": 768,
    "dtype": jnp.float32,  # not a literal: ignored by the parent, used by create_inputs
}


def create_inputs(dtype=jnp.float32):
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (CONFIG["M"], CONFIG["K"]), dtype=dtype)  # f32[m, k]
    w = jax.random.normal(kw, (CONFIG["K"], CONFIG["N"]), dtype=dtype) / 16.0  # f32[k, n]
    return x, w


def workload(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def get_flops():
    return 2 * CONFIG["M"] * CONFIG["K"] * CONFIG["N"]
