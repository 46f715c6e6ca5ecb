"""Grouped matmul (MoE expert GEMM): rows of lhs are split into consecutive groups by an int
group_sizes vector (sums to the row count, groups may be empty); group g multiplies rhs[g]."""

import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        m, k, n, g = 16384, 4096, 2048, 8
    else:
        m, k, n, g = 256, 256, 256, 4
    k_l, k_r, k_g = jax.random.split(jax.random.key(12), 3)
    lhs = jax.random.normal(k_l, (m, k), jnp.float32).astype(dtype)
    rhs = (jax.random.normal(k_r, (g, k, n), jnp.float32) * k**-0.5).astype(dtype)
    cuts = jnp.sort(jax.random.randint(k_g, (g - 1,), 0, m + 1))
    bounds = jnp.concatenate([jnp.zeros((1,), cuts.dtype), cuts, jnp.full((1,), m, cuts.dtype)])
    group_sizes = jnp.diff(bounds).astype(jnp.int32)
    return [lhs, rhs, group_sizes], []


def computation(lhs, rhs, group_sizes):
    out = lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)
