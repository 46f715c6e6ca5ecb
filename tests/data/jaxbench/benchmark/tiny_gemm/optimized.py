"""Hand-written Pallas GEMM for tiny_gemm, shaped like JAXBench's optimized.py files: a complete workload
module of its own (CONFIG, create_inputs, workload) whose `workload` runs the kernel.

Tiling: (BLOCK_M, BLOCK_N) output tiles, K reduced over the last ("arbitrary") grid axis in BLOCK_K steps
into an f32 VMEM accumulator. 512-row tiles divide the workload's M (1536) and its divisibility-keeping
shrink (512); the grid is derived from the input shapes, never from CONFIG.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

CONFIG = {"name": "tiny_gemm_pallas", "M": 1536, "K": 256, "N": 768}

BLOCK_M = 512
BLOCK_N = 256
BLOCK_K = 128


def x_index_map(m_index, n_index, k_index):
    return m_index, k_index


def w_index_map(m_index, n_index, k_index):
    return k_index, n_index


def out_index_map(m_index, n_index, k_index):
    return m_index, n_index


def _gemm_kernel(x_ref, w_ref, o_ref, acc_scratch):
    # x_ref: f32[BLOCK_M, BLOCK_K]; w_ref: f32[BLOCK_K, BLOCK_N]; o_ref, acc_scratch: f32[BLOCK_M, BLOCK_N]
    @pl.when(pl.program_id(2) == 0)
    def _init():
        acc_scratch[...] = jnp.zeros_like(acc_scratch)

    acc_scratch[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _store():
        o_ref[...] = acc_scratch[...].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k"))
def gemm(x, w, *, block_m=BLOCK_M, block_n=BLOCK_N, block_k=BLOCK_K):
    m, k = x.shape  # f32[m, k]
    _, n = w.shape  # f32[k, n]
    if m % block_m or n % block_n or k % block_k:
        raise ValueError(f"({m}, {n}, {k}) is not a multiple of the blocks ({block_m}, {block_n}, {block_k})")
    return pl.pallas_call(
        _gemm_kernel,
        grid=(m // block_m, n // block_n, k // block_k),
        in_specs=[
            pl.BlockSpec((block_m, block_k), x_index_map),
            pl.BlockSpec((block_k, block_n), w_index_map),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), out_index_map),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    )(x, w)


def create_inputs(dtype=jnp.float32):
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (CONFIG["M"], CONFIG["K"]), dtype=dtype)
    w = jax.random.normal(kw, (CONFIG["K"], CONFIG["N"]), dtype=dtype) / 16.0
    return x, w


def workload(x, w):
    return gemm(x, w)
