"""A Pallas kernel that does arithmetic but ignores the inputs."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _kernel(x_ref, o_ref):
    o_ref[...] = jnp.full(o_ref.shape, 0.5, o_ref.dtype) * 2.0


def computation(x, w, b):
    m, n = x.shape[0], w.shape[1]
    return pl.pallas_call(
        _kernel,
        grid=(m // 128,),
        in_specs=[pl.BlockSpec((128, x.shape[1]), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((128, n), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
    )(x)
