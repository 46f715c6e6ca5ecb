"""Reads an uninitialised output block and launders the interpreters' poison. The K reduction accumulates
straight into the output block, which is never zeroed: the kernel maps NaN to 0 on every read instead. Every
interpreter fills a fresh output block with NaN, so the first K step reads 0 and the kernel is right there.
On a TPU an output block's VMEM buffer is not cleared between blocks (it holds whatever the previous block or
kernel left in it, finite garbage), so the sum starts from garbage: wrong on the hardware."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 128


def _kernel(x_ref, w_ref, b_ref, o_ref):
    kk = pl.program_id(2)
    prev = jnp.nan_to_num(o_ref[...], nan=0.0, posinf=0.0, neginf=0.0)
    acc = prev + jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)
    o_ref[...] = jnp.where(kk == pl.num_programs(2) - 1, jnp.maximum(acc + b_ref[...], 0.0), acc)


def computation(x, w, b):
    m, k = x.shape
    n = w.shape[1]
    return pl.pallas_call(
        _kernel,
        grid=(m // BLOCK_M, n // BLOCK_N, k // BLOCK_K),
        in_specs=[
            pl.BlockSpec((BLOCK_M, BLOCK_K), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((BLOCK_K, BLOCK_N), lambda i, j, kk: (kk, j)),
            pl.BlockSpec((1, BLOCK_N), lambda i, j, kk: (0, j)),
        ],
        out_specs=pl.BlockSpec((BLOCK_M, BLOCK_N), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    )(x, w, b.reshape(1, n))
