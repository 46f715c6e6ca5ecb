"""Declares its reduction axis 'parallel'. The grid is K alone; each step adds one K slice's product to a
scratch accumulator (zeroed at the first step) and the last step writes the whole output block. Every step
revisits the same output block, so the steps depend on each other. Interpreters and single-core chips run
the grid in order, so it is right there. On a device whose TensorCores split 'parallel' dimensions between
them (v5p, v4), one core runs the first half of K and never writes, the other starts from an unzeroed
scratch and writes half a sum: wrong there, and the block model credits it with both cores."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK_K = 128


def _kernel(x_ref, w_ref, b_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(0) == pl.num_programs(0) - 1)
    def _():
        o_ref[...] = jnp.maximum(acc_ref[...] + b_ref[...], 0.0).astype(o_ref.dtype)


def computation(x, w, b):
    m, k = x.shape
    n = w.shape[1]
    return pl.pallas_call(
        _kernel,
        grid=(k // BLOCK_K,),
        in_specs=[
            pl.BlockSpec((m, BLOCK_K), lambda kk: (0, kk)),
            pl.BlockSpec((BLOCK_K, n), lambda kk: (kk, 0)),
            pl.BlockSpec((1, n), lambda kk: (0, 0)),
        ],
        out_specs=pl.BlockSpec((m, n), lambda kk: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        scratch_shapes=[pltpu.VMEM((m, n), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
    )(x, w, b.reshape(1, n))
