"""Hand-written row scaling whose grid comes from CONFIG, not from the inputs: right at the workload's own
shapes, wrong at any other. The maxkernel tests use it to check that such a kernel is reported failing at
the shrunk validation shapes, with the harness's message."""

import jax
from jax.experimental import pallas as pl

BLOCK_M = 512
M_FROM_CONFIG = 1536  # the bug: the real shape baked in


def row_index_map(m_index):
    return m_index, 0


def _scale_kernel(x_ref, s_ref, o_ref):
    # x_ref: f32[BLOCK_M, n]; s_ref: f32[BLOCK_M, 1]
    o_ref[...] = x_ref[...] * s_ref[...]


def workload(x, s):
    _, n = x.shape
    return pl.pallas_call(
        _scale_kernel,
        grid=(M_FROM_CONFIG // BLOCK_M,),
        in_specs=[pl.BlockSpec((BLOCK_M, n), row_index_map), pl.BlockSpec((BLOCK_M, 1), row_index_map)],
        out_specs=pl.BlockSpec((BLOCK_M, n), row_index_map),
        out_shape=jax.ShapeDtypeStruct((M_FROM_CONFIG, n), x.dtype),
    )(x, s)
