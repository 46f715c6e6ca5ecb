"""relu(x @ w + b) as a tiled Pallas TPU kernel (hand-written example candidate).

Tiling: the output is cut into (BLOCK_M, BLOCK_N) tiles; each grid step (i, j, k) multiplies an
x tile (BLOCK_M, BLOCK_K) by a w tile (BLOCK_K, BLOCK_N) on the MXU and accumulates into an f32 VMEM
scratch. The bias add and relu run once per output tile, at the last k step, so the epilogue costs no
extra HBM traffic. Grid order (m, n, k) with k innermost keeps the accumulator resident.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK_M = 128
BLOCK_N = 128
BLOCK_K = 256


def _matmul_bias_relu_kernel(x_ref, w_ref, b_ref, o_ref, acc_scratch):
    k_index = pl.program_id(2)

    @pl.when(k_index == 0)
    def _init():
        acc_scratch[...] = jnp.zeros_like(acc_scratch)

    acc_scratch[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

    @pl.when(k_index == pl.num_programs(2) - 1)
    def _epilogue():
        y = acc_scratch[...] + b_ref[...].astype(jnp.float32)  # f32[bm, bn]
        o_ref[...] = jnp.maximum(y, 0.0).astype(o_ref.dtype)


def x_index_map(m_index, n_index, k_index):
    return (m_index, k_index)


def w_index_map(m_index, n_index, k_index):
    return (k_index, n_index)


def b_index_map(m_index, n_index, k_index):
    return (0, n_index)


def o_index_map(m_index, n_index, k_index):
    return (m_index, n_index)


@functools.partial(jax.jit, static_argnames=())
def computation(x, w, b):
    m, k = x.shape  # f32[m, k]
    _, n = w.shape  # f32[k, n]
    bm, bn, bk = min(BLOCK_M, m), min(BLOCK_N, n), min(BLOCK_K, k)
    if m % bm or n % bn or k % bk:
        raise ValueError(f"shapes {(m, k, n)} must be multiples of the blocks {(bm, bk, bn)}")
    b2 = b.reshape(1, n)  # f32[1, n]
    return pl.pallas_call(
        _matmul_bias_relu_kernel,
        grid=(m // bm, n // bn, k // bk),
        in_specs=[
            pl.BlockSpec((bm, bk), x_index_map),
            pl.BlockSpec((bk, bn), w_index_map),
            pl.BlockSpec((1, bn), b_index_map),
        ],
        out_specs=pl.BlockSpec((bm, bn), o_index_map),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    )(x, w, b2)
