"""A hand-written kernel for static_rows (maxkernel test): doubles the first `keep` rows, 128 at a time."""

import jax
from jax.experimental import pallas as pl

BLOCK_ROWS = 128


def row_block(i):
    return i, 0


def _double_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0


def workload(x, keep):
    cols = x.shape[1]
    return pl.pallas_call(
        _double_kernel,
        grid=(keep // BLOCK_ROWS,),
        in_specs=[pl.BlockSpec((BLOCK_ROWS, cols), row_block)],
        out_specs=pl.BlockSpec((BLOCK_ROWS, cols), row_block),
        out_shape=jax.ShapeDtypeStruct((keep, cols), x.dtype),
    )(x)
