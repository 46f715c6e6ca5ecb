"""Class 6: a program tree nested far deeper than Python's recursion limit, and a malformed one, in the
file the agent reads back. It must end as a clear rejection, not a RecursionError in the agent."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _kernel(x_ref, w_ref, b_ref, o_ref):
    o_ref[...] = jnp.maximum(jnp.dot(x_ref[...], w_ref[...]) + b_ref[...], 0.0)


def computation(x, w, b):
    m, n = x.shape[0], w.shape[1]
    return pl.pallas_call(_kernel, out_shape=jax.ShapeDtypeStruct((m, n), x.dtype))(x, w, b.reshape(1, n))


try:
    from maxkernel.tools import program_tree

    def _deep(_jaxpr):
        tree = {"eqns": []}
        for _ in range(50_000):
            tree = {"eqns": [{"p": "pjit", "subs": [tree]}]}
        return tree

    program_tree.to_tree = _deep
except Exception:
    pass
