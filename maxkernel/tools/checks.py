"""Does Pallas do the work? A static check of the candidate's jaxpr.

Outside `pallas_call` the candidate may only rearrange data (reshape, transpose, pad, cast, slice, ...)
and do light elementwise work. Everything else found outside a kernel — a `dot_general`, a convolution, a
reduction, a loop, a sort — is rejected, and the rules are an allow-list, so a primitive this module has
never heard of counts as heavy rather than slipping through. Host callbacks are rejected anywhere: they
would let Python compute the answer behind the tracer's back.

Two more rules catch kernels that exist only for show: every kernel must do arithmetic (a kernel that only
copies a jnp-computed result is rejected), and elementwise work outside kernels must not outweigh the work
inside them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from maxkernel.tools.results import PallasCheck

LAYOUT_OUTSIDE = frozenset(
    """reshape transpose broadcast_in_dim squeeze expand_dims pad convert_element_type slice dynamic_slice
    dynamic_update_slice concatenate copy copy_p iota rev bitcast_convert_type reduce_precision gather split
    device_put sharding_constraint stop_gradient optimization_barrier""".split()
)
ELEMENTWISE_OUTSIDE = frozenset(
    """add sub mul div neg exp exp2 log log1p expm1 tanh logistic max min abs sign pow integer_pow sqrt rsqrt
    cbrt erf erfc erf_inv select_n eq ne lt le gt ge and or not xor clamp floor ceil round sin cos tan
    is_finite nextafter rem atan2 shift_left shift_right_logical shift_right_arithmetic square population_count
    random_bits random_seed random_wrap random_unwrap random_fold_in random_split threefry2x32""".split()
)
STRUCTURAL = frozenset(
    """pjit jit closed_call core_call custom_jvp_call custom_vjp_call custom_vjp_call_jaxpr remat checkpoint
    cond named_call""".split()
)
FORBIDDEN = frozenset("pure_callback io_callback callback host_callback outside_call".split())
WARN_ONLY = frozenset({"debug_callback", "debug_print"})

# Inside a kernel: primitives that move or index data rather than compute.
KERNEL_DATA_MOVEMENT = frozenset(
    """get swap load store masked_load masked_swap program_id num_programs broadcast_in_dim reshape squeeze
    transpose convert_element_type iota copy copy_p slice dynamic_slice concatenate dma_start dma_wait
    semaphore_signal semaphore_wait semaphore_read run_scoped bitcast delay pjit closed_call cond scan while
    expand_dims multiple_of""".split()
)


def _subjaxprs(params: dict[str, Any]) -> Iterator[Any]:
    """Every jaxpr held in an equation's params (single, closed, or in tuples such as cond branches)."""
    for value in params.values():
        items = value if isinstance(value, list | tuple) else (value,)
        for item in items:
            inner = getattr(item, "jaxpr", None)
            if hasattr(item, "eqns"):
                yield item
            elif inner is not None and hasattr(inner, "eqns"):
                yield inner


def _size(aval: Any) -> int:
    n = 1
    for d in getattr(aval, "shape", ()):
        n *= int(d) if isinstance(d, int) else 1
    return n


def _out_elems(eqn: Any) -> int:
    return sum(_size(v.aval) for v in eqn.outvars)


def _dot_flops(eqn: Any) -> float:
    lhs = eqn.invars[0].aval
    (contract_lhs, _), _ = eqn.params["dimension_numbers"]
    k = 1
    for axis in contract_lhs:
        k *= int(lhs.shape[axis])
    return 2.0 * _out_elems(eqn) * k


def kernel_work(jaxpr: Any) -> tuple[float, int]:
    """(work, number of compute equations) of one kernel body, for a single grid step."""
    work = 0.0
    ops = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        trips = 1
        if name == "scan":
            trips = int(eqn.params.get("length", 1))
        for sub in _subjaxprs(eqn.params):
            w, n = kernel_work(sub)
            work += trips * w
            ops += n
        if name in KERNEL_DATA_MOVEMENT or name in STRUCTURAL:
            continue
        ops += 1
        work += _dot_flops(eqn) if name == "dot_general" else _out_elems(eqn)
    return work, ops


def _grid_steps(eqn: Any) -> int:
    grid = getattr(eqn.params.get("grid_mapping"), "grid", ()) or ()
    steps = 1
    for g in grid:
        steps *= int(g) if isinstance(g, int) else 1
    return steps


class _Walker:
    def __init__(self) -> None:
        self.check = PallasCheck(ok=True)
        self.copy_only_kernels = 0
        self.warnings: list[str] = []

    def walk(self, jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "pallas_call":
                self.check.pallas_calls += 1
                body = eqn.params["jaxpr"]
                work, ops = kernel_work(body)
                self._forbidden_inside(body)
                if ops == 0:
                    self.copy_only_kernels += 1
                self.check.work_inside += work * _grid_steps(eqn)
                continue
            if name in FORBIDDEN:
                self.check.forbidden.append(name)
                continue
            if name in WARN_ONLY:
                self.warnings.append(f"{name} outside Pallas")
                continue
            if name in STRUCTURAL:
                for sub in _subjaxprs(eqn.params):
                    self.walk(sub)
                continue
            if name in LAYOUT_OUTSIDE:
                continue
            shapes = ", ".join(str(v.aval.str_short()) for v in eqn.outvars)
            if name in ELEMENTWISE_OUTSIDE:
                self.check.elementwise_outside.append(f"{name} -> {shapes}")
                self.check.work_outside += _out_elems(eqn)
            else:
                self.check.heavy_outside.append(f"{name} -> {shapes}")

    def _forbidden_inside(self, jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in FORBIDDEN:
                self.check.forbidden.append(f"{eqn.primitive.name} (inside a kernel)")
            for sub in _subjaxprs(eqn.params):
                self._forbidden_inside(sub)


def check_pallas_does_work(closed_jaxpr: Any) -> tuple[PallasCheck, list[str]]:
    """Classify a candidate's jaxpr. Returns the check and warnings to surface (e.g. debug prints)."""
    walker = _Walker()
    walker.walk(getattr(closed_jaxpr, "jaxpr", closed_jaxpr))
    c = walker.check
    warnings = list(walker.warnings)
    if c.elementwise_outside:
        warnings.append(
            f"{len(c.elementwise_outside)} elementwise op(s) run outside Pallas: "
            + "; ".join(c.elementwise_outside[:5])
        )
    if c.forbidden:
        c.ok, c.reason = False, "host callbacks are not allowed: " + ", ".join(sorted(set(c.forbidden)))
    elif c.pallas_calls == 0:
        c.ok, c.reason = False, "no pallas_call in the candidate: the work is not done in Pallas"
    elif c.heavy_outside:
        c.ok = False
        c.reason = "work outside Pallas kernels: " + "; ".join(c.heavy_outside[:6])
    elif walker.copy_only_kernels == c.pallas_calls:
        c.ok = False
        c.reason = "the Pallas kernels only move data; the arithmetic happens outside them"
    elif c.work_outside > c.work_inside:
        c.ok = False
        c.reason = (
            f"most elementwise work runs outside Pallas ({c.work_outside:.3g} element-ops outside vs "
            f"{c.work_inside:.3g} inside)"
        )
    return c, warnings
