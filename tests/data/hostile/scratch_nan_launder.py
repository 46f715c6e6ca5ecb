"""Reads an uninitialised scratch accumulator and launders the interpreters' poison. One output tile per
(M, N) block, the K reduction in a VMEM scratch that is never zeroed: every step maps NaN to 0 in what it
reads instead. Both interpreters allocate scratch filled with NaN, so the first step reads 0 and the kernel
is right there as long as each scratch buffer serves one output tile (the whole [M, N] output in one block,
with K on the grid). On a TPU a scratch buffer holds whatever VMEM held before (finite garbage from an
earlier kernel or call): wrong on the hardware."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK_K = 128


def _kernel(x_ref, w_ref, b_ref, o_ref, acc_ref):
    acc = jnp.nan_to_num(acc_ref[...], nan=0.0, posinf=0.0, neginf=0.0)
    acc_ref[...] = acc + jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

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
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
    )(x, w, b.reshape(1, n))
