"""Helpers shared by the offline author's test files: lower a reference, load the module the author
renders for it, check that module in TPU interpret mode and compile it ahead of time for the TPU."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

import maxkernel.tools.tpu_specs  # noqa: F401 - lets compile-only libtpu load next to other processes
from maxkernel.authors.base import TileConfig
from maxkernel.authors.offline.lower import lower_program
from maxkernel.authors.offline.render import render, undefined_names
from maxkernel.authors.offline.spec import ProgramSpec
from maxkernel.authors.offline.trace import Config, trace_reference
from maxkernel.authors.offline.tuning import default_config
from maxkernel.tools.estimate import topology_device
from maxkernel.tools.harness import EvalOptions

TPU = ["v5e", "v6e"]
Shape = tuple[int, ...]


def acceptance_options(tpu: list[str], timeout_s: float = 300) -> EvalOptions:
    """The harness's options for a test that a kernel is *accepted*: every check that decides acceptance
    (the Pallas check, interpret-mode correctness on 3 input sets and the larger shape, AOT Mosaic compile
    per generation at the task's own shapes), without the speed estimate, which never decides acceptance
    (`harness._verdict`) and is tested on its own (test_estimate*, test_harness, test_bench). The estimate's
    reference half is an XLA compile per generation at the task's own shapes: 20-67 s for a 1000x1536x5000
    f32 HIGHEST matmul at load 8, more than the rest of such an evaluation."""
    return EvalOptions(tpu=tpu, timeout_s=timeout_s, estimate=False)


def conv_program(
    fn: Callable, shapes: Sequence[Sequence[Shape]], dtype: str, names: Sequence[str] = ("x", "w", "b"), **kw
) -> ProgramSpec:
    """The offline author's program for a convolution reference traced at every configuration in `shapes`
    (all arguments of one dtype), with stride-1 convolutions kept whole for the direct conv kernel; `kw`
    goes to `lower_program` (e.g. `options=FUSION_LEVELS[1]`)."""
    configs = [Config(dynamic=[(s, dtype) for s in case], static=[]) for case in shapes]
    return lower_program(trace_reference(fn, configs, list(names), direct_conv=True), "t", **kw)


def load_module(program: ProgramSpec, config: TileConfig | None = None, tpu: list[str] = TPU):
    """Render `program` at `config` (the author's default for `tpu` when None) and load it here, in the test
    process (these tests check the author's own output; candidate code from elsewhere never runs here).
    Returns the source and its `computation`."""
    src = render(program, config if config is not None else default_config(program, tpu), tpu)
    assert undefined_names(src) == [], src
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    return src, ns["computation"]


def check_interpreted(fn, kernel, args, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Run a generated `computation` in TPU interpret mode and compare every output (shape, dtype, values)
    with the reference function on the same arguments."""
    with pltpu.force_tpu_interpret_mode():
        got = kernel(*args)
    want = fn(*(jnp.asarray(a) for a in args))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), atol=atol, rtol=rtol)


def check_on_normal_inputs(
    fn,
    kernel,
    shapes: Sequence[Sequence[Shape]],
    dtype,
    rng: np.random.Generator,
    *,
    scale: float = 0.5,
    atol: float,
    rtol: float,
) -> None:
    """`check_interpreted` on each configuration in `shapes`, every argument drawn from N(0, scale²)."""
    for case in shapes:
        args = [jnp.asarray(scale * rng.standard_normal(s), dtype) for s in case]
        check_interpreted(fn, kernel, args, atol=atol, rtol=rtol)


def compiles(kernel, specs: Sequence[tuple[Shape, object]], tpu: list[str] = TPU) -> None:
    """Compile `kernel` ahead of time with the real Mosaic compiler for every generation in `tpu`, at the
    argument (shape, dtype) pairs in `specs`; a Mosaic error fails the test."""
    for gen in tpu:
        sharding = jax.sharding.SingleDeviceSharding(topology_device(gen))
        avals = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in specs]
        jax.jit(kernel).trace(*avals).lower().compile()


def compiles_at(kernel, shapes: Sequence[Sequence[Shape]], dtype, tpu: list[str] = TPU) -> None:
    """`compiles` at each configuration in `shapes`, every argument of `dtype`."""
    for case in shapes:
        compiles(kernel, [(s, dtype) for s in case], tpu)
