"""Class 6: the programs file it leaves for the agent is JSON nested far deeper than Python's recursion
limit. It must end as a clear rejection, not a RecursionError in the agent."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


BLOCK_M, BLOCK_N = 128, 128


def _kernel(x_ref, w_ref, b_ref, o_ref):
    acc = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)
    o_ref[...] = jnp.maximum(acc + b_ref[...], 0.0)


def computation(x, w, b):
    m, k = x.shape
    n = w.shape[1]
    return pl.pallas_call(
        _kernel,
        grid=(m // BLOCK_M, n // BLOCK_N),
        in_specs=[
            pl.BlockSpec((BLOCK_M, k), lambda i, j: (i, 0)),
            pl.BlockSpec((k, BLOCK_N), lambda i, j: (0, j)),
            pl.BlockSpec((1, BLOCK_N), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((BLOCK_M, BLOCK_N), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
    )(x, w, b.reshape(1, n))


try:
    import json

    from maxkernel.tools import candidate as _harness_side

    class _DeepJson:
        """What the harness's process writes as programs.json: nested far past any recursion limit."""

        loads = staticmethod(json.loads)

        @staticmethod
        def dumps(obj, **kwargs):
            if isinstance(obj, dict) and "validation" in obj:
                return '{"validation": ' + "[" * 200_000 + "]" * 200_000 + "}"
            return json.dumps(obj, **kwargs)

    _harness_side.json = _DeepJson
except Exception:
    pass
