"""One trace per shape, and every artifact of an evaluation derived from it by our code.

The candidate's Python runs once per shape (`trace_once`): whatever it does to recognise *which* artifact
it is building (the call stack, a call count, interpret mode) it does before any artifact exists, so all
of them describe the same program. From that one closed jaxpr this module derives, with no candidate code
involved (the candidate's process runs it, so a candidate that rewrites this module in its own process
can still hand over other bytes; the judge's checks are what hold then, see `harness`):

* `with_interpret`: the same jaxpr with every `pallas_call` switched to TPU interpret mode, which the
  candidate's process runs on the judge's inputs (its outputs are a cross-check: uninitialised memory is
  NaN there and out-of-bounds reads raise);
* `export_checked`: one `jax.export` module for two platforms: on "cpu" each kernel is Pallas's plain
  interpreter (the kernel body as XLA ops), on "tpu" the Mosaic kernel, and every operation outside the
  kernels shared by both. The judge runs it on CPU on its secret inputs (the evidence of correctness)
  and reads the TPU side's kernels, which it compares with the program that ships;
* `export_tpu`: the program that ships, lowered for the TPU only, at the task's own shapes;
* the program tree (`program_tree.to_tree`) and the block-model estimate read the same jaxpr.

Lowering for the TPU on a machine without one asks the local device for its TPU kind in a few Mosaic rules
(`//`, `%` and `jnp.sign` in a kernel): a CPU answers "Unsupported TPU device kind: cpu". The exports
therefore run under an abstract mesh whose device is the first requested TPU generation's, so those
rules see a TPU; no libtpu is needed for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from types import SimpleNamespace
from typing import Any

_installed = False


def install_interpreter_rule() -> None:
    """Make a `pallas_call` lowered for "cpu" without an interpret flag lower to Pallas's plain
    interpreter (JAX raises there otherwise). Flagged calls (TPU interpret mode) keep JAX's own rule."""
    global _installed
    if _installed:
        return
    from jax._src.interpreters import mlir
    from jax._src.pallas import hlo_interpreter
    from jax._src.pallas import pallas_call as pallas_call_module

    jax_rule = pallas_call_module._pallas_call_lowering

    def cpu_rule(ctx: Any, *in_nodes: Any, interpret: Any, **params: Any) -> Any:
        if interpret:
            return jax_rule(ctx, *in_nodes, interpret=interpret, **params)
        impl = partial(hlo_interpreter.pallas_call_hlo_interpret, **params)
        with _stale_memory(hlo_interpreter):
            return mlir.lower_fun(impl, multiple_results=True)(ctx, *in_nodes)

    mlir.register_lowering(pallas_call_module.pallas_call_p, cpu_rule, platform="cpu")
    _installed = True


STALE_SCALE = 43.758
"""Magnitude of the finite values the judge's interpreter leaves in scratch buffers (`_stale_memory`)."""


@contextmanager
def _stale_memory(hlo_interpreter: Any) -> Iterator[None]:
    """While a kernel lowers to Pallas's plain interpreter (the program the judge runs), memory a kernel
    has not written holds finite, data-like values, as a TPU's VMEM holds stale data: a float scratch buffer
    starts as a fixed finite pattern, and the overhang of a block that runs past its array (a partial last
    block) holds the array's own values, wrapped round, times -3 (3 unsigned), plus 1. JAX's interpreter fills both with
    NaN, which a kernel can launder (`nan_to_num` on an accumulator it never zeroed, on padding it never
    masked): right in every interpreter, wrong on the chip. Outputs still start as NaN (an unwritten output
    is reported as such); the candidate's TPU-interpret-mode cross-check keeps NaN everywhere, so a kernel
    that relies on either value is caught by one of the two runs."""
    import jax.numpy as jnp
    from jax import lax

    primitives = hlo_interpreter.primitives
    honest_pad = hlo_interpreter._pad_to_block_dimension
    honest_outputs = hlo_interpreter._initialize_output_vals

    def stale_value(shape: Any, dtype: Any) -> Any:
        if not jnp.issubdtype(dtype, jnp.floating):
            return primitives.uninitialized_value(shape, dtype)  # semaphores (int16) must stay 0
        size = math.prod(shape) if shape else 1
        pattern = jnp.sin(lax.iota(jnp.float32, size) * 12.9898 + 0.5) * STALE_SCALE
        return pattern.reshape(shape).astype(dtype)

    def stale_pad(value: Any, block_shape: Any) -> Any:
        padded = tuple(((v - 1) // b + 1) * b for v, b in zip(value.shape, block_shape, strict=False))
        number = jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer)
        if padded == tuple(value.shape) or not number or value.size == 0 or len(padded) != value.ndim:
            return honest_pad(value, block_shape)
        widths = tuple((0, a - b) for a, b in zip(padded, value.shape, strict=True))
        wrapped = jnp.pad(value, widths, mode="wrap")
        inside = jnp.pad(jnp.ones(value.shape, bool), widths)
        factor = 3 if jnp.issubdtype(value.dtype, jnp.unsignedinteger) else -3
        return jnp.where(
            inside, wrapped, wrapped * jnp.asarray(factor, value.dtype) + jnp.asarray(1, value.dtype)
        )

    def nan_outputs(*args: Any, **kwargs: Any) -> Any:
        hlo_interpreter.primitives = primitives
        try:
            return honest_outputs(*args, **kwargs)
        finally:
            hlo_interpreter.primitives = stale

    stale = SimpleNamespace(**{k: getattr(primitives, k) for k in dir(primitives) if not k.startswith("__")})
    stale.uninitialized_value = stale_value
    hlo_interpreter.primitives = stale
    hlo_interpreter._pad_to_block_dimension = stale_pad
    hlo_interpreter._initialize_output_vals = nan_outputs
    try:
        yield
    finally:
        hlo_interpreter.primitives = primitives
        hlo_interpreter._pad_to_block_dimension = honest_pad
        hlo_interpreter._initialize_output_vals = honest_outputs


def trace_once(fn: Callable[..., Any], specs: list[Any], device_kind: str, cores: int = 1) -> Any:
    """The closed jaxpr of `fn` at `specs`: the one time the candidate's Python runs for these shapes.
    Traced under the abstract TPU device the exports are lowered for: a jaxpr's equations keep the mesh
    they were traced under, and re-lowering them under another would not see the TPU."""
    import jax
    from jax.sharding import use_abstract_mesh

    with use_abstract_mesh(_abstract_tpu(device_kind, cores)):
        return jax.jit(fn).trace(*specs).jaxpr


def _nested(params: dict[str, Any], rewrite: Callable[[Any], Any]) -> dict[str, Any]:
    from jax.extend import core as jex_core

    out = {}
    for k, v in params.items():
        if isinstance(v, jex_core.ClosedJaxpr):
            v = v.replace(jaxpr=rewrite(v.jaxpr))
        elif isinstance(v, jex_core.Jaxpr):
            v = rewrite(v)
        elif isinstance(v, tuple) and v and all(isinstance(x, jex_core.ClosedJaxpr) for x in v):
            v = tuple(x.replace(jaxpr=rewrite(x.jaxpr)) for x in v)
        out[k] = v
    return out


def with_interpret(closed: Any, interpret: Any) -> Any:
    """`closed` with every pallas_call (at any depth outside kernels) run with `interpret` (True: Pallas's
    plain interpreter; `pltpu.InterpretParams`: TPU interpret mode). Nothing is traced again."""

    def rewrite(jaxpr: Any) -> Any:
        eqns = []
        for e in jaxpr.eqns:
            if e.primitive.name == "pallas_call":
                params = {**e.params, "interpret": interpret}
                eqns.append(e.replace(params=params, effects=_pallas_effects(e, params)))
            else:
                params = _nested(e.params, rewrite)
                eqns.append(e.replace(params=params, effects=e.effects | _inner_effects(params)))
        effects = set(jaxpr.effects).union(*(e.effects for e in eqns))
        return jaxpr.replace(eqns=eqns, effects=effects)

    return closed.replace(jaxpr=rewrite(closed.jaxpr))


def _pallas_effects(eqn: Any, params: dict[str, Any]) -> Any:
    """The effects of a pallas_call under new params: TPU interpret mode runs its simulation in ordered
    host callbacks, which every enclosing jaxpr (a jitted candidate's pjit) must carry to lower."""
    try:
        _, effects = eqn.primitive.abstract_eval(*(v.aval for v in eqn.invars), **params)
    except Exception:  # noqa: BLE001 - no effectful rule: keep what the trace recorded
        return eqn.effects
    return eqn.effects | set(effects)


def _inner_effects(params: dict[str, Any]) -> set[Any]:
    from jax.extend import core as jex_core

    out: set[Any] = set()
    for v in params.values():
        items = v if isinstance(v, tuple) else (v,)
        for x in items:
            if isinstance(x, jex_core.ClosedJaxpr | jex_core.Jaxpr):
                out |= set(x.effects)
    return out


def as_function(closed: Any) -> Callable[..., Any]:
    from jax.extend import core as jex_core

    return jex_core.jaxpr_as_fun(closed)


def _all_eqns(closed: Any) -> Iterator[Any]:
    from maxkernel.tools.jaxpr import walk_eqns

    return walk_eqns(closed)


def platform_dependent(closed: Any) -> list[str]:
    """Where `closed` (kernel bodies included) lowers differently per platform; [] when nowhere."""
    from maxkernel.tools.jaxpr import PLATFORM_DEPENDENT

    found = []
    for eqn in _all_eqns(closed):
        if eqn.primitive.name in PLATFORM_DEPENDENT:
            found.append(eqn.primitive.name)
    return found


def _abstract_tpu(device_kind: str, cores: int) -> Any:
    from jax.sharding import AbstractDevice, AbstractMesh

    device = AbstractDevice(device_kind=device_kind, num_cores=cores, platform="tpu")
    return AbstractMesh((1,), ("maxkernel",), abstract_device=device)


def export_checked(closed: Any, specs: list[Any], device_kind: str, cores: int = 1) -> bytes:
    """One module, two platforms: the plain interpreter on "cpu" (what the judge runs), Mosaic on "tpu"."""
    import jax
    from jax import export
    from jax.sharding import use_abstract_mesh

    install_interpreter_rule()
    with use_abstract_mesh(_abstract_tpu(device_kind, cores)):
        exported = export.export(jax.jit(as_function(closed)), platforms=("cpu", "tpu"))(*specs)
    return exported.serialize()


def export_tpu(closed: Any, specs: list[Any], device_kind: str, cores: int = 1) -> bytes:
    """The program that ships: `closed` lowered for the TPU (Mosaic kernels) only."""
    import jax
    from jax import export
    from jax.sharding import use_abstract_mesh

    with use_abstract_mesh(_abstract_tpu(device_kind, cores)):
        exported = export.export(jax.jit(as_function(closed)), platforms=("tpu",))(*specs)
    return exported.serialize()
