"""Hand-written Pallas GEMM for tiny_gemm, exporting `workload` as JAXBench's optimized.py files do.

Tiling: (BLOCK_M, BLOCK_N) output tiles, the whole K (256) in one step, so each tile is one MXU pass with
no accumulator. 512-row tiles divide the workload's M (1536) and its divisibility-keeping shrink (512).
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK_M = 512
BLOCK_N = 256


def x_index_map(m_index, n_index):
    return m_index, 0


def w_index_map(m_index, n_index):
    return 0, n_index


def out_index_map(m_index, n_index):
    return m_index, n_index


def _gemm_kernel(x_ref, w_ref, o_ref):
    # x_ref: f32[BLOCK_M, k]; w_ref: f32[k, BLOCK_N]; o_ref: f32[BLOCK_M, BLOCK_N]
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32).astype(o_ref.dtype)


def workload(x, w):
    m, k = x.shape  # f32[m, k]
    _, n = w.shape  # f32[k, n]
    if m % BLOCK_M or n % BLOCK_N:
        raise ValueError(f"({m}, {n}) is not a multiple of the blocks ({BLOCK_M}, {BLOCK_N})")
    return pl.pallas_call(
        _gemm_kernel,
        grid=(m // BLOCK_M, n // BLOCK_N),
        in_specs=[
            pl.BlockSpec((BLOCK_M, k), x_index_map),
            pl.BlockSpec((k, BLOCK_N), w_index_map),
        ],
        out_specs=pl.BlockSpec((BLOCK_M, BLOCK_N), out_index_map),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
    )(x, w)
