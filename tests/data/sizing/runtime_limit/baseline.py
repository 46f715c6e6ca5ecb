"""A workload whose reference fails at run time (not while tracing) when its rows exceed 256, the way an
XLA:CPU allocation fails on a machine too small (maxkernel test): validation must retry smaller."""

import jax
import jax.numpy as jnp
import numpy as np

CONFIG = {"name": "runtime_limit", "rows": 2048, "cols": 128}


def _guard(x):
    if x.shape[0] > 256:
        raise MemoryError(f"cannot allocate {x.shape[0]} rows here")
    return np.asarray(x)


def create_inputs(dtype=jnp.float32):
    return (jax.random.normal(jax.random.key(2), (CONFIG["rows"], CONFIG["cols"]), dtype),)


def workload(x):
    checked = jax.pure_callback(_guard, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return jnp.tanh(checked) * 3.0
