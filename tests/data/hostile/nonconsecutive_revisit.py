"""Accumulates into output blocks it revisits out of order. K is the outermost grid axis, so each output
block (i, j) is visited once per K step, with every other block in between; the kernel zeroes it at the
first K step and adds to `o_ref` after. Pallas's plain interpreter keeps the whole output as one array and
re-reads the block each visit, so the sum is right there. On a TPU an output block is written back when its
index changes and never fetched again: the next visit starts from whatever the VMEM buffer holds, so the
result is wrong on the hardware."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 128


def _kernel(x_ref, w_ref, b_ref, o_ref):
    kk = pl.program_id(0)

    @pl.when(kk == 0)
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)

    o_ref[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

    @pl.when(kk == pl.num_programs(0) - 1)
    def _():
        o_ref[...] = jnp.maximum(o_ref[...] + b_ref[...], 0.0)


def computation(x, w, b):
    m, k = x.shape
    n = w.shape[1]
    return pl.pallas_call(
        _kernel,
        grid=(k // BLOCK_K, m // BLOCK_M, n // BLOCK_N),
        in_specs=[
            pl.BlockSpec((BLOCK_M, BLOCK_K), lambda kk, i, j: (i, kk)),
            pl.BlockSpec((BLOCK_K, BLOCK_N), lambda kk, i, j: (kk, j)),
            pl.BlockSpec((1, BLOCK_N), lambda kk, i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((BLOCK_M, BLOCK_N), lambda kk, i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary", "arbitrary")),
    )(x, w, b.reshape(1, n))
