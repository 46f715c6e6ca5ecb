"""An honest Pallas kernel whose process lies about its speed: it rewrites the block model (which runs in
the candidate's process, needing the live jaxpr) so that every estimate it reports is a thousandth of the
truth, structural counts included. Correct, so accepted; the lie must not become its estimated speedup."""
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:
    import maxkernel.tools.estimate as estimate

    _real = estimate.estimate_pallas

    def _flattering(*args, **kwargs):
        est = _real(*args, **kwargs)
        shrink = {k: getattr(est, k) / 1000 for k in ("estimated_seconds", "est_pallas_seconds", "est_hbm_bytes",
                                                      "est_mxu_flops")}
        calls = [c.model_copy(update={"est_hbm_bytes": c.est_hbm_bytes / 1000}) for c in est.pallas_calls]
        return est.model_copy(update={**shrink, "est_grid_steps": 1, "pallas_calls": calls})

    estimate.estimate_pallas = _flattering
except Exception:
    pass


def _kernel(x_ref, w_ref, b_ref, o_ref):
    acc = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)
    o_ref[...] = jnp.maximum(acc + b_ref[...], 0.0).astype(o_ref.dtype)


def computation(x, w, b):
    m, k = x.shape
    n = w.shape[1]
    bm, bn = min(m, 128), min(n, 128)
    return pl.pallas_call(
        _kernel,
        grid=(m // bm, n // bn),
        in_specs=[
            pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
            pl.BlockSpec((k, bn), lambda i, j: (0, j)),
            pl.BlockSpec((1, bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
    )(x, w, b.reshape(1, n))
