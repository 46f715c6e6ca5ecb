"""A correct kernel for tasks/transposed_bf16_matmul: one kernel writes 2x, XLA transposes it, a second
kernel multiplies in bf16 with f32 accumulation. XLA:CPU fails to run it under Pallas's plain interpreter
("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"); TPU interpret mode runs it."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2


def _matmul(a_ref, b_ref, o_ref):
    o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)


def computation(x, w):
    y = pl.pallas_call(_double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    yt = jnp.transpose(y)
    out_shape = jax.ShapeDtypeStruct((yt.shape[0], w.shape[1]), jnp.float32)
    return pl.pallas_call(_matmul, out_shape=out_shape)(yt, w)
