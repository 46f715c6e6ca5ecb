"""Estimate inflation through the block model's index arithmetic: the kernel's compute sits under a
`pl.when` whose predicate is grid-position arithmetic that overflows int32. On the TPU (and in every
interpreter) `step * 65536 * 65536` wraps to 0 at every step, so the guarded matmul runs on every step and
the kernel is right. The block model replays that predicate over the grid in int64, where it is 0 only at
step 0, and charges the matmul for 1 step in `steps`: a false speedup from a kernel that patches nothing."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

BLOCK_N = 128


def _kernel(x_ref, w_ref, b_ref, o_ref):
    step = pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)
    wrapped = (step * 65536) * 65536  # int32: always 0

    @pl.when(wrapped == 0)
    def _():
        acc = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32,
                            precision=jax.lax.Precision.HIGHEST)
        o_ref[...] = jnp.maximum(acc + b_ref[...], 0.0).astype(o_ref.dtype)


def computation(x, w, b):
    m, k = x.shape
    n = w.shape[1]
    bm = min(m, 256)
    return pl.pallas_call(
        _kernel,
        grid=(m // bm, n // BLOCK_N),
        in_specs=[
            pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
            pl.BlockSpec((k, BLOCK_N), lambda i, j: (0, j)),
            pl.BlockSpec((1, BLOCK_N), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, BLOCK_N), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
    )(x, w, b.reshape(1, n))
