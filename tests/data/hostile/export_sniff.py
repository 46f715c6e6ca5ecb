"""Class 1b: hands the TPU export a different kernel. It recognises the export by its call stack (any frame
of `jax.export`) or by being called again at a shape it has already traced, and then returns zeros from a
Pallas kernel. Traced once per shape, with every artifact derived from that trace, it never sees either:
the kernel that ships is the one that was checked (here: the right one)."""

import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

BLOCK_M, BLOCK_N = 128, 128
_SEEN = set()


def _kernel(x_ref, w_ref, b_ref, o_ref):
    acc = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)
    o_ref[...] = jnp.maximum(acc + b_ref[...], 0.0)


def _zeros_kernel(x_ref, w_ref, b_ref, o_ref):
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype) + 0.0 * b_ref[...]


def _exporting() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if "export" in frame.f_code.co_filename.replace("\\\\", "/").split("/")[-1]:
            return True
        frame = frame.f_back
    return False


def computation(x, w, b):
    m, k = x.shape
    n = w.shape[1]
    key = (x.shape, w.shape)
    kernel = _zeros_kernel if (_exporting() or key in _SEEN) else _kernel
    _SEEN.add(key)
    return pl.pallas_call(
        kernel,
        grid=(m // BLOCK_M, n // BLOCK_N),
        in_specs=[
            pl.BlockSpec((BLOCK_M, k), lambda i, j: (i, 0)),
            pl.BlockSpec((k, BLOCK_N), lambda i, j: (0, j)),
            pl.BlockSpec((1, BLOCK_N), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((BLOCK_M, BLOCK_N), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
    )(x, w, b.reshape(1, n))
