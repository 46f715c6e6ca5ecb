"""A workload whose generator returns a Python int after its arrays (maxkernel test): JAXBench's runner
passes it to `workload` as a static size, and so must maxkernel (a traced value cannot size a slice)."""

import jax
import jax.numpy as jnp

CONFIG = {"name": "static_rows", "rows": 512, "cols": 256}


def create_inputs(dtype=jnp.float32):
    x = jax.random.normal(jax.random.key(1), (CONFIG["rows"], CONFIG["cols"]), dtype)
    keep = CONFIG["rows"] // 2
    return x, keep


def workload(x, keep):
    return jax.lax.dynamic_slice(x, (0, 0), (keep, x.shape[1])) * 2.0
