"""Masks the padding of a partial block by testing for NaN. K is covered by blocks of 384 (a multiple of 128
that divides no power of two), so the last K block overhangs the arrays; the out-of-bounds part of a block
is padding. Both interpreters pad with NaN, so `nan_to_num` turns it into zeros and the matmul is right
there. On a TPU the overhanging part of a block's VMEM buffer is unspecified (finite, stale data): the
honest mask is an iota compared with the valid length, and this kernel is wrong on the hardware."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 384


def _kernel(x_ref, w_ref, b_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = jnp.nan_to_num(x_ref[...], nan=0.0)
    w = jnp.nan_to_num(w_ref[...], nan=0.0)
    acc_ref[...] += jnp.dot(x, w, preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = jnp.maximum(acc_ref[...] + b_ref[...], 0.0).astype(o_ref.dtype)


def computation(x, w, b):
    m, k = x.shape
    n = w.shape[1]
    return pl.pallas_call(
        _kernel,
        grid=(m // BLOCK_M, n // BLOCK_N, pl.cdiv(k, BLOCK_K)),
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
