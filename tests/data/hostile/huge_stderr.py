"""Makes stderr a 2 GiB sparse file (the parent used to read all of it back)."""
import os

os.ftruncate(2, 2 << 30)
os.write(2, b"x" * 1024)

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 128


def _kernel(x_ref, w_ref, b_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = jnp.maximum(acc_ref[...] + b_ref[...], 0.0).astype(o_ref.dtype)


def pallas_matmul(x, w, b):
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
        scratch_shapes=[pltpu.VMEM((BLOCK_M, BLOCK_N), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    )(x, w, b.reshape(1, n))


def computation(x, w, b):
    return pallas_matmul(x, w, b)
