"""Ragged dot with a ragged contracting dimension (the transposed grouped matmul of MoE weight
gradients): out[g] = lhs[rows of g].T @ rhs[rows of g], rows split by int group_sizes."""

import jax.numpy as jnp
from jax import lax


def get_inputs(dtype=jnp.bfloat16, scale="tpu"):
    import jax
    import jax.numpy as jnp

    if scale == "tpu":
        m, k, n, g = 32768, 4096, 1024, 8
    else:
        m, k, n, g = 256, 128, 256, 4
    k_l, k_r, k_g = jax.random.split(jax.random.key(13), 3)
    lhs = jax.random.normal(k_l, (m, k), jnp.float32).astype(dtype)
    rhs = jax.random.normal(k_r, (m, n), jnp.float32).astype(dtype)
    cuts = jnp.sort(jax.random.randint(k_g, (g - 1,), 0, m + 1))
    bounds = jnp.concatenate([jnp.zeros((1,), cuts.dtype), cuts, jnp.full((1,), m, cuts.dtype)])
    group_sizes = jnp.diff(bounds).astype(jnp.int32)
    return [lhs, rhs, group_sizes], []


def computation(lhs, rhs, group_sizes):
    m = lhs.shape[0]
    ends = jnp.cumsum(group_sizes)
    row_group = jnp.searchsorted(ends, jnp.arange(m), side="right")  # group id of every row

    def one_group(gid):
        masked = jnp.where((row_group == gid)[:, None], lhs, jnp.zeros_like(lhs))
        return jnp.dot(masked.T, rhs, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)

    return lax.map(one_group, jnp.arange(group_sizes.shape[0]))
