"""Class 2b: XLA does the matmul as a broadcast multiply and an add tree (elementwise ops only), while the
kernel runs a busy loop whose result is multiplied by zero, to outweigh the work outside. Only kernel work
that reaches an output earns credit, and elementwise work many times the program's inputs and outputs is
work, not glue."""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

BUSY_STEPS = 64


def _kernel(y_ref, b_ref, o_ref):
    y = y_ref[...]

    def busy(_i, acc):
        return jnp.tanh(acc * 1.0001 + 0.5) * jnp.exp(acc * 0.001)

    noise = lax.fori_loop(0, BUSY_STEPS, busy, y)
    o_ref[...] = jnp.maximum(y + b_ref[...], 0.0) + noise * 0.0


def computation(x, w, b):
    m, k = x.shape
    n = w.shape[1]
    prod = x[:, :, None] * w[None, :, :]  # f32[m, k, n]
    y = prod[:, 0, :]
    for kk in range(1, k):
        y = y + prod[:, kk, :]
    return pl.pallas_call(_kernel, out_shape=jax.ShapeDtypeStruct((m, n), x.dtype))(y, b.reshape(1, n))
