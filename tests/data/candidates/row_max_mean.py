"""An honest kernel for tasks/small_rowmax_mean: the kernel reduces every row (all the work); the mean of
the one value per row that it returns is left to XLA, small glue judged by its cost."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

BLOCK_ROWS = 128


def _row_max_kernel(x_ref, o_ref):
    o_ref[...] = jnp.max(x_ref[...], axis=1, keepdims=True)  # f32[BLOCK_ROWS, 1]


def computation(x):
    rows, cols = x.shape
    row_max = pl.pallas_call(
        _row_max_kernel,
        grid=(rows // BLOCK_ROWS,),
        in_specs=[pl.BlockSpec((BLOCK_ROWS, cols), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((BLOCK_ROWS, 1), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((rows, 1), x.dtype),
    )(x)
    return jnp.mean(row_max)
