"""A GEMM + group norm whose workload hard-codes its width (maxkernel test, modelled on a common pattern):
the generator's `out_features` cannot shrink (the reshape would break), `in_features` and the batch can."""

import jax
import jax.numpy as jnp

CONFIG = {"name": "hardcoded_groups"}


def create_inputs(dtype=jnp.float32):
    batch_size, in_features, out_features = 1024, 512, 512
    k1, k2 = jax.random.split(jax.random.key(5))
    x = jax.random.normal(k1, (batch_size, in_features), dtype)
    w = jax.random.normal(k2, (in_features, out_features), dtype) * 0.05
    return x, w


def workload(x, w):
    out_features = 512
    groups = 16
    y = jnp.dot(x, w).reshape(x.shape[0], groups, out_features // groups)
    y = (y - y.mean(-1, keepdims=True)) / jnp.sqrt(y.var(-1, keepdims=True) + 1e-5)
    return y.reshape(x.shape[0], out_features)
