"""An honest kernel for tasks/small_abs_scale: a flattened 1-D grid whose index maps recover the block's row
and column with `//` and `%`, and a body that uses `jnp.sign`. On a CPU-only host these lowered for the TPU
only on a TPU device kind ("Unsupported TPU device kind: cpu"); they must be accepted."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

BLOCK_ROWS, BLOCK_COLS = 8, 128


def _abs_scale_kernel(x_ref, o_ref):
    x = x_ref[...]  # f32[BLOCK_ROWS, BLOCK_COLS]
    o_ref[...] = 2.0 * x * jnp.sign(x) + 1.0


def computation(x):
    rows, cols = x.shape
    col_blocks = cols // BLOCK_COLS

    def block_index_map(flat_index):
        return flat_index // col_blocks, flat_index % col_blocks

    spec = pl.BlockSpec((BLOCK_ROWS, BLOCK_COLS), block_index_map)
    return pl.pallas_call(
        _abs_scale_kernel,
        grid=((rows // BLOCK_ROWS) * col_blocks,),
        in_specs=[spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    )(x)
