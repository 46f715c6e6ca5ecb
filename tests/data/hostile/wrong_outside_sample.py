"""Class 5 (task small_gelu): tanh-GELU that is right only where the task's public sample lies (|x| <= 5;
standard normal values rarely go past 4.5) and zero beyond. Draws clipped to the sample's range never leave
it; the wide draw family (scaled, shifted, special values) does."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _gelu_kernel(x_ref, o_ref):
    x = x_ref[...]
    o_ref[...] = jnp.where(jnp.abs(x) <= 5.0, jax.nn.gelu(x, approximate=True), 0.0)


def computation(x):
    rows, cols = x.shape
    return pl.pallas_call(
        _gelu_kernel,
        grid=(rows // 128,),
        in_specs=[pl.BlockSpec((128, cols), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((128, cols), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    )(x)
