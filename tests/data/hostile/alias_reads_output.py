"""Reads its output block expecting the aliased input's data. The bias is broadcast to [m, n] outside the
kernel and aliased to the output (`input_output_aliases`); the kernel never reads that input's block, it
reads `o_ref` and adds the matmul to it. Both interpreters start the aliased output as a copy of the input,
so `o_ref` holds the bias and the kernel is right there. On a TPU an output block is only written back, never
fetched: its VMEM buffer holds garbage, and the result is wrong on the hardware."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

BLOCK_M, BLOCK_N = 128, 128


def _kernel(x_ref, w_ref, bias_ref, o_ref):
    del bias_ref  # read through o_ref instead
    acc = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)
    o_ref[...] = jnp.maximum(o_ref[...] + acc, 0.0).astype(o_ref.dtype)


def computation(x, w, b):
    m, k = x.shape
    n = w.shape[1]
    bias = jnp.broadcast_to(b.reshape(1, n), (m, n))
    return pl.pallas_call(
        _kernel,
        grid=(m // BLOCK_M, n // BLOCK_N),
        in_specs=[
            pl.BlockSpec((BLOCK_M, k), lambda i, j: (i, 0)),
            pl.BlockSpec((k, BLOCK_N), lambda i, j: (0, j)),
            pl.BlockSpec((BLOCK_M, BLOCK_N), lambda i, j: (i, j)),
        ],
        out_specs=pl.BlockSpec((BLOCK_M, BLOCK_N), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        input_output_aliases={2: 0},
    )(x, w, bias)
