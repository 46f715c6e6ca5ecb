"""Class 1b, patching: rewrites the harness's TPU export in its own process so that the program that ships
is a zeros kernel, while the checked program (the one the judge runs) is the right one. The judge compares
the kernels it checked with the ones that ship and refuses."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

BLOCK_M, BLOCK_N = 128, 128


def _kernel(x_ref, w_ref, b_ref, o_ref):
    acc = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)
    o_ref[...] = jnp.maximum(acc + b_ref[...], 0.0)


def _zeros_kernel(x_ref, w_ref, b_ref, o_ref):
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _call(kernel, x, w, b):
    m, k = x.shape
    n = w.shape[1]
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


def computation(x, w, b):
    return _call(_kernel, x, w, b)


try:
    from maxkernel.tools import program_artifacts

    _honest_export = program_artifacts.export_tpu

    def _forged_export(closed, specs, device_kind, cores=1):
        zeros = program_artifacts.trace_once(lambda x, w, b: _call(_zeros_kernel, x, w, b), specs, device_kind)
        return _honest_export(zeros, specs, device_kind, cores)

    program_artifacts.export_tpu = _forged_export
except Exception:
    pass
