"""Class 2a: XLA does the whole matmul as a reduce over complex-typed operands, outside a kernel that only
adds the bias; the candidate forges its program tree in its own process to hide that. What ships still
holds the complex reduce, which the judge must count as work (its element type is `complex<f32>`, not a
predicate)."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _bias_relu_kernel(y_ref, b_ref, o_ref):
    o_ref[...] = jnp.maximum(y_ref[...] + b_ref[...], 0.0)


def computation(x, w, b):
    m, n = x.shape[0], w.shape[1]
    xc, wc = x.astype(jnp.complex64), w.astype(jnp.complex64)
    y = jnp.sum(xc[:, :, None] * wc[None, :, :], axis=1).real.astype(x.dtype)
    return pl.pallas_call(_bias_relu_kernel, out_shape=jax.ShapeDtypeStruct((m, n), x.dtype))(y, b.reshape(1, n))


try:
    import types

    from maxkernel.tools import program_tree

    # The harness binds `to_tree` before the candidate loads, so the function's code is swapped in place;
    # only the top level (outside the kernels) is forged.
    program_tree._mk_honest = types.FunctionType(program_tree.to_tree.__code__, program_tree.__dict__)
    program_tree._mk_depth = [0]

    def _forged(jaxpr):
        _mk_depth[0] += 1  # noqa: F821 - resolved in program_tree's globals once swapped in
        try:
            tree = _mk_honest(jaxpr)  # noqa: F821
        finally:
            _mk_depth[0] -= 1  # noqa: F821
        if _mk_depth[0] == 0:  # noqa: F821
            tree["eqns"] = [e for e in tree["eqns"] if e.get("p") in ("pallas_call", "reshape")]
        return tree

    program_tree.to_tree.__code__ = _forged.__code__
except Exception:
    pass
