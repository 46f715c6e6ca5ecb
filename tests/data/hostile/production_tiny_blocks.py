"""Class 1c: right at every shape the harness runs, but at the task's own (production) shapes a one-step
kernel with tiny blocks: the block-model estimate of that program is far faster than the kernel that was
checked, and the program that ships leaves most of its output unwritten. The judge reads both programs'
kernels and refuses."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _kernel(x_ref, w_ref, b_ref, o_ref):
    acc = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)
    o_ref[...] = jnp.maximum(acc + b_ref[...], 0.0)


def computation(x, w, b):
    m, k = x.shape
    n = w.shape[1]
    bm, bn, bk = (128, 128, k) if m < 1024 else (8, 128, 128)  # production: one step, tiny blocks
    grid = (m // bm, n // bn) if m < 1024 else (1, 1)
    return pl.pallas_call(
        _kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((bm, bk), lambda i, j: (i, 0)),
            pl.BlockSpec((bk, bn), lambda i, j: (0, j)),
            pl.BlockSpec((1, bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
    )(x, w, b.reshape(1, n))
