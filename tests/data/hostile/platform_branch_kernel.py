"""Class 1a: `lax.platform_dependent` inside the kernel body. The CPU interpreter takes the `cpu` branch
(right), Mosaic takes the default one (zeros): every check run on the CPU would pass while the TPU program
is wrong. It must be refused as platform-dependent."""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

BLOCK_M, BLOCK_N = 128, 128


def _kernel(x_ref, w_ref, b_ref, o_ref):
    acc = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)
    right = jnp.maximum(acc + b_ref[...], 0.0)
    o_ref[...] = lax.platform_dependent(right, cpu=lambda r: r, default=jnp.zeros_like)


def computation(x, w, b):
    m, k = x.shape
    n = w.shape[1]
    return pl.pallas_call(
        _kernel,
        grid=(m // BLOCK_M, n // BLOCK_N),
        in_specs=[
            pl.BlockSpec((BLOCK_M, k), lambda i, j: (i, 0)),
            pl.BlockSpec((k, BLOCK_N), lambda i, j: (0, j)),
            pl.BlockSpec((1, BLOCK_N), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((BLOCK_M, BLOCK_N), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
    )(x, w, b.reshape(1, n))
