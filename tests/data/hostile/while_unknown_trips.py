"""Estimate inflation through an in-kernel loop the block model cannot count: the whole K reduction of the
matmul runs in a `while_loop` whose trip count comes from a scalar-prefetch value the wrapper derives from
the data (always K / 128, but not provably so). The block model charges an unknown-trip loop body once, so
the kernel's MXU work is priced at 1/16 of what runs at the task's shapes. The kernel is right and patches
nothing; only its estimate is false."""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BK, BM, BN = 128, 256, 128


def _kernel(nk_ref, x_ref, w_ref, b_ref, o_ref):
    def body(c):
        kk, acc = c
        start = pl.multiple_of(kk * BK, BK)
        acc = acc + jnp.dot(x_ref[:, pl.ds(start, BK)], w_ref[pl.ds(start, BK), :],
                            preferred_element_type=jnp.float32,
                            precision=jax.lax.Precision.HIGHEST)
        return kk + 1, acc

    _, acc = lax.while_loop(lambda c: c[0] < nk_ref[0], body,
                            (jnp.int32(0), jnp.zeros(o_ref.shape, jnp.float32)))
    o_ref[...] = jnp.maximum(acc + b_ref[...], 0.0).astype(o_ref.dtype)


def computation(x, w, b):
    m, k = x.shape
    n = w.shape[1]
    bm = min(m, BM)
    # k // BK, whatever the data; 0 * (x != x) only hides that from a static reading
    nk = (k // BK + 0 * (x[0, :1] != x[0, :1]).astype(jnp.int32)).astype(jnp.int32)
    return pl.pallas_call(
        _kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(m // bm, n // BN),
            in_specs=[
                pl.BlockSpec((bm, k), lambda i, j, nk: (i, 0)),
                pl.BlockSpec((k, BN), lambda i, j, nk: (0, j)),
                pl.BlockSpec((1, BN), lambda i, j, nk: (0, j)),
            ],
            out_specs=pl.BlockSpec((bm, BN), lambda i, j, nk: (i, j)),
        ),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
    )(nk, x, w, b.reshape(1, n))
