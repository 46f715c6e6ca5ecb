"""Correct at the validation shapes, wrong at every larger one, with the same program everywhere.

The branch on shape picks a Python float, not a program: at 128 rows or fewer the output is scaled by
1.0, above that by 0.0. The same primitives run at every shape (the scale is a literal in a `mul`), so the
interpret/plain and validation/production structure checks accept it, the Pallas check sees a kernel doing
the matmul, the TPU program compiles, and the outputs at the 128-row validation shapes are right. Only
running it at a second, larger shape shows the zeros.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 128
VALIDATION_ROWS = 128


def _kernel(x_ref, w_ref, b_ref, o_ref, acc_ref, *, scale):
    @pl.when(pl.program_id(2) == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        out = jnp.maximum(acc_ref[...] + b_ref[...], 0.0) * scale
        o_ref[...] = out.astype(o_ref.dtype)


def computation(x, w, b):
    m, k = x.shape
    n = w.shape[1]
    scale = 1.0 if m <= VALIDATION_ROWS else 0.0  # a Python float: no branch in the traced program
    return pl.pallas_call(
        lambda *refs: _kernel(*refs, scale=scale),
        grid=(m // BLOCK_M, n // BLOCK_N, k // BLOCK_K),
        in_specs=[
            pl.BlockSpec((BLOCK_M, BLOCK_K), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((BLOCK_K, BLOCK_N), lambda i, j, kk: (kk, j)),
            pl.BlockSpec((1, BLOCK_N), lambda i, j, kk: (0, j)),
        ],
        out_specs=pl.BlockSpec((BLOCK_M, BLOCK_N), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        scratch_shapes=[pltpu.VMEM((BLOCK_M, BLOCK_N), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    )(x, w, b.reshape(1, n))
