"""Helpers shared by the offline author's test files."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from maxkernel.tools.harness import EvalOptions


def acceptance_options(tpu: list[str], timeout_s: float = 300) -> EvalOptions:
    """The harness's options for a test that a kernel is *accepted*: every check that decides acceptance
    (the Pallas check, interpret-mode correctness on 3 input sets and the larger shape, AOT Mosaic compile
    per generation at the task's own shapes), without the speed estimate, which never decides acceptance
    (`harness._verdict`) and is tested on its own (test_estimate*, test_harness, test_bench). The estimate's
    reference half is an XLA compile per generation at the task's own shapes: 20-67 s for a 1000x1536x5000
    f32 HIGHEST matmul at load 8, more than the rest of such an evaluation."""
    return EvalOptions(tpu=tpu, timeout_s=timeout_s, estimate=False)


def check_interpreted(fn, kernel, args, atol: float = 1e-5) -> None:
    """Run a generated `computation` in TPU interpret mode and compare every output (shape, dtype, values)
    with the reference function on the same arguments."""
    with pltpu.force_tpu_interpret_mode():
        got = kernel(*args)
    want = fn(*(jnp.asarray(a) for a in args))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), atol=atol, rtol=1e-5)


def aot_compiles(kernel, specs, tpu: list[str]) -> None:
    """Compile a generated `computation` ahead of time with the real Mosaic compiler for each generation
    (`specs`: (shape, dtype) per argument); raises on any compiler error."""
    from maxkernel.tools.estimate import topology_device

    for gen in tpu:
        sharding = jax.sharding.SingleDeviceSharding(topology_device(gen))
        avals = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in specs]
        jax.jit(kernel).trace(*avals).lower().compile()
