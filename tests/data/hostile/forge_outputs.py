"""Class 4: a wrong kernel (no bias) whose process replaces what its compiled interpret-mode programs
return with the reference computed in plain jnp: the outputs it reports are right. The judge runs the
checked program itself on its own inputs, so the forged outputs are a cross-check that changes nothing."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

BLOCK_M, BLOCK_N = 128, 128


def _kernel(x_ref, w_ref, o_ref):
    o_ref[...] = jnp.maximum(jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32), 0.0)


def computation(x, w, b):
    m, k = x.shape
    n = w.shape[1]
    return pl.pallas_call(
        _kernel,
        grid=(m // BLOCK_M, n // BLOCK_N),
        in_specs=[pl.BlockSpec((BLOCK_M, k), lambda i, j: (i, 0)), pl.BlockSpec((k, BLOCK_N), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((BLOCK_M, BLOCK_N), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
    )(x, w)


try:
    from maxkernel.tools import candidate as _harness_side

    def _reference_outputs(self):
        return lambda x, w, b: [jax.nn.relu(jnp.dot(x, w) + b)]

    _harness_side._BackgroundCompile.result = _reference_outputs
except Exception:
    pass
