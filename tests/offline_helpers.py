"""Helpers shared by the offline author's test files."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu


def check_interpreted(fn, kernel, args, atol: float = 1e-5) -> None:
    """Run a generated `computation` in TPU interpret mode and compare every output (shape, dtype, values)
    with the reference function on the same arguments."""
    with pltpu.force_tpu_interpret_mode():
        got = kernel(*args)
    want = fn(*(jnp.asarray(a) for a in args))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), atol=atol, rtol=1e-5)
