"""Jaxpr primitive catalogs and the one walk over nested jaxprs, shared by every module that reads jaxprs.

Three readers classify primitives, for three different questions, and this is their one home:

* the harness's Pallas check (`checks`): what may run *outside* a kernel, and which kernels only move data;
* the block-model estimator (`estimate`): what a primitive costs inside a kernel and in plain XLA;
* the offline author (`authors.offline`): what a primitive becomes when the reference is turned into
  kernels (re-emitted map, absorbed layout change, reduction, dot, glue left to XLA).

Where two catalogs look alike but differ, the difference is deliberate and each pair is defined side by
side below with the reason. Names are jaxpr primitive names in JAX 0.10.2.

The walk (`walk_eqns`) visits the equations of a jaxpr and of every jaxpr nested in their params (call
bodies, cond branches, scan/while bodies, custom_jvp/vjp functions, pallas_call kernel bodies) in program
order; callers that treat some nesting specially (a cond's cheapest branch, a scan's trip count) decide
per equation whether to enter it.

This module imports JAX only inside the walking functions: the catalogs are read by the harness's checks,
which work on plain data and need no JAX.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

# --------------------------------------------------------------------------------------------------------
# Elementwise maps
# --------------------------------------------------------------------------------------------------------

_MAPS = frozenset(
    """add sub mul div neg exp exp2 log log1p expm1 tanh logistic max min abs sign pow integer_pow sqrt
    rsqrt cbrt erf erfc erf_inv select_n eq ne lt le gt ge and or not xor clamp floor ceil round sin cos
    tan atan2 is_finite rem square shift_left shift_right_logical shift_right_arithmetic nextafter""".split()
)
"""Same-shape n-ary maps every reader agrees on."""

RANDOM_KEYS = frozenset(
    "random_seed random_bits random_wrap random_unwrap random_fold_in random_split".split()
)
"""Random-key plumbing (typed PRNG keys in and out)."""

ELEMENTWISE = _MAPS | frozenset("add_any reduce_precision asin acos atan sinh cosh asinh acosh atanh".split())
"""Offline author: maps it re-emits inside a kernel. Includes the inverse/hyperbolic trig maps it has
lowerings for, `add_any` (what transposition leaves) and `reduce_precision` (a cast-like map)."""

ELEMENTWISE_OUTSIDE = _MAPS | RANDOM_KEYS | frozenset({"population_count", "threefry2x32"})
"""Pallas check: light elementwise work a candidate may leave to XLA outside its kernels (counted and
weighed against the work inside). Unlike `ELEMENTWISE` it admits random-number generation (`threefry2x32`
and key plumbing: a dropout mask drawn in XLA is legitimate) and leaves out the rarer trig maps, which
count as heavy work outside a kernel (the check is an allow-list); `reduce_precision` is layout there."""

RANDOM = RANDOM_KEYS | frozenset({"bitcast_convert_type"})
"""Offline author: random-number plumbing that stays outside kernels as XLA (the harness allows it
there), with the bit casts that turn random bits into floats; so does any elementwise work that depends
only on it (turning bits into a dropout mask). Draws the author reproduces exactly (32-bit partitionable
threefry) never reach this table: `authors.offline.threefry` rewrites them into maps that kernels
compute on their own blocks, and a same-width bitcast is then a map too. `threefry2x32` is not here: the author has no template for
raw counter-based generation and reports it unsupported."""

# --------------------------------------------------------------------------------------------------------
# Layout: what moves or reinterprets data without computing
# --------------------------------------------------------------------------------------------------------

LAYOUT_OUTSIDE = frozenset(
    """reshape transpose broadcast_in_dim squeeze expand_dims pad convert_element_type slice dynamic_slice
    dynamic_update_slice concatenate copy copy_p iota rev bitcast_convert_type reduce_precision gather split
    device_put sharding_constraint stop_gradient optimization_barrier""".split()
)
"""Pallas check: data rearrangement a candidate may do outside its kernels, free of charge."""

FREE_IN_XLA = frozenset(
    {"reshape", "squeeze", "expand_dims", "bitcast_convert_type", "optimization_barrier", "copy_p"}
)
"""Estimator: outside kernels, what XLA does without touching HBM (a bitcast or a no-op). Much smaller
than `LAYOUT_OUTSIDE`: a transpose or a pad is *allowed* outside a kernel but still costs an HBM pass."""

XLA_LOOP_FUSIBLE = _MAPS | frozenset(
    """reshape transpose broadcast_in_dim squeeze expand_dims pad convert_element_type slice concatenate copy
    copy_p iota rev reduce_precision""".split()
)
"""Estimator: ops outside kernels that XLA fuses into one loop fusion with their neighbours of this set
(elementwise maps and layout): a chain of them between kernels reads its inputs once and writes what leaves
it once, whatever the number of ops on the way."""

ABSORBED = frozenset(
    "convert_element_type broadcast_in_dim squeeze expand_dims transpose copy copy_p iota reshape".split()
)
"""Offline author: layout changes a kernel sees through without moving data (inside a kernel they are
aliases or casts). Reshapes count only when they add or drop unit dims; the others are `GLUE`."""

GLUE = frozenset("reshape slice dynamic_slice concatenate pad gather rev split dynamic_update_slice".split())
"""Offline author: real layout ops that stay outside `pallas_call` as plain XLA (a subset of
`LAYOUT_OUTSIDE`, so the harness allows them there)."""

# --------------------------------------------------------------------------------------------------------
# Reductions, dots, transcendentals
# --------------------------------------------------------------------------------------------------------

REDUCE = frozenset("reduce_sum reduce_max reduce_min argmax argmin reduce_and reduce_or top_k".split())
"""Offline author: the reductions it has kernel templates for."""

REDUCTIONS = frozenset(
    {
        "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor",
        "argmax", "argmin", "cumsum", "cummax", "cummin", "cumprod", "cumlogsumexp", "reduce_precision",
    }
)  # fmt: skip
"""Estimator: primitives charged per *input* element on the VPU inside a kernel (every reduction and scan
it may meet, templated or not; `reduce_precision` reads as much as it writes)."""

DOT = frozenset({"dot_general"})

TRANSCENDENTAL = frozenset(
    {
        "exp", "exp2", "expm1", "log", "log1p", "tanh", "logistic", "erf", "erfc", "erf_inv", "sin", "cos",
        "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh", "pow", "rsqrt",
        "sqrt", "cbrt", "lgamma", "digamma", "igamma", "random_gamma_grad", "bessel_i0e", "bessel_i1e",
    }
)  # fmt: skip
"""Estimator: maps that run on the EUP (transcendental unit) rather than the VPU."""

# --------------------------------------------------------------------------------------------------------
# Inside a kernel: what does no arithmetic
# --------------------------------------------------------------------------------------------------------

KERNEL_DATA_MOVEMENT = frozenset(
    """get swap load store masked_load masked_swap program_id num_programs broadcast_in_dim reshape squeeze
    transpose convert_element_type iota copy copy_p slice dynamic_slice concatenate dma_start dma_wait
    semaphore_signal semaphore_wait semaphore_read run_scoped bitcast delay pjit closed_call cond scan while
    expand_dims multiple_of""".split()
)
"""Pallas check: kernel equations that move or index data. A kernel made only of these (and of calls) is
a copy-only kernel, which is rejected. Broad on purpose: a transpose or cast alone is no real work."""

FREE_IN_KERNEL = frozenset(
    {
        "program_id", "num_programs", "get", "swap", "load", "store", "masked_load", "masked_swap",
        "reshape", "squeeze", "expand_dims", "bitcast_convert_type", "dma_wait", "semaphore_signal",
        "semaphore_wait", "semaphore_read", "barrier", "delay", "pjit", "jit", "debug_callback",
        "debug_print", "multiple_of", "assume_multiple", "run_scoped", "optimization_barrier",
    }
)  # fmt: skip
"""Estimator: kernel equations it does not charge. Loads/stores are vld/vst slots, shape ops are layout
bookkeeping, the rest is scalar or synchronisation work. Unlike `KERNEL_DATA_MOVEMENT`, a transpose,
broadcast, cast or iota *is* charged here (it writes vregs), and `dma_start` is charged as DMA bytes."""

# --------------------------------------------------------------------------------------------------------
# Calls and control flow
# --------------------------------------------------------------------------------------------------------

CALL_PRIMITIVES: dict[str, str] = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat": "jaxpr",
    "checkpoint": "jaxpr",
    "named_call": "call_jaxpr",
}
"""Calls whose body is the computation (inlined by the offline author's flattening), each with the param
that holds the body."""

STRUCTURAL = frozenset(CALL_PRIMITIVES) | frozenset({"cond"})
"""Pallas check: equations outside kernels that only wrap other equations; the check walks into them."""

KERNEL_CALL_PRIMITIVES = (frozenset(CALL_PRIMITIVES) - {"named_call"}) | frozenset(
    {"custom_lin", "shard_map", "run_scoped"}
)
"""Estimator: equations inside a kernel whose nested bodies are charged as if inlined. Adds the
kernel-only scope (`run_scoped`) and the wrappers that appear in differentiated or sharded bodies."""

FORBIDDEN = frozenset("pure_callback io_callback callback host_callback outside_call".split())
"""Host callbacks: they would let Python compute the answer behind the tracer's back. Rejected anywhere."""

WARN_ONLY = frozenset({"debug_callback", "debug_print"})
"""Host callbacks that only print: surfaced as a warning, not rejected."""

PLATFORM_DEPENDENT = frozenset({"platform_index"})
"""Lowering that differs by platform (`lax.platform_dependent`): the CPU interpreter that checks a kernel
and the TPU that runs it would take different branches. Refused anywhere in a candidate."""

SHAPE_MASKING: frozenset[str] = frozenset(
    """lt le gt ge eq ne and or not select_n iota broadcast_in_dim convert_element_type min max rem
    pad slice dynamic_slice dynamic_update_slice concatenate reshape squeeze expand_dims transpose
    jit pjit closed_call""".split()
)
"""Primitives whose presence may legitimately depend on the shapes: the masks and padding a kernel needs
only where a dim does not divide its block (unaligned validation shapes, aligned production ones), and the
call wrappers around such helpers (whose bodies are walked and counted on their own). They
compute no result of their own; a kernel that drops a dot, an exp or a reduction at one shape is still
caught, and so is one that drops or adds a kernel."""

# --------------------------------------------------------------------------------------------------------
# Walking
# --------------------------------------------------------------------------------------------------------


def use_counts(jaxpr: Any) -> dict[Any, int]:
    """How many times each variable of `jaxpr` is read (by its equations and as an output); literals left
    out."""
    from jax.extend import core as jcore

    uses: dict[Any, int] = {}
    for v in [*(v for e in jaxpr.eqns for v in e.invars), *jaxpr.outvars]:
        if not isinstance(v, jcore.Literal):
            uses[v] = uses.get(v, 0) + 1
    return uses


def as_jaxpr(j: Any) -> tuple[Any, Sequence[Any]]:
    """(jaxpr, consts) of a Jaxpr or ClosedJaxpr."""
    from jax.extend import core as jex_core

    if isinstance(j, jex_core.ClosedJaxpr):
        return j.jaxpr, j.consts
    if isinstance(j, jex_core.Jaxpr):
        return j, ()
    raise TypeError(f"expected a Jaxpr or ClosedJaxpr, got {type(j).__name__}")


def sub_jaxprs(eqn: Any) -> list[Any]:
    """Every jaxpr nested in an equation's params (call bodies, cond branches, scan/while bodies,
    custom_jvp/vjp functions, a pallas_call's kernel body), as open jaxprs."""
    from jax.extend import core as jex_core

    return [as_jaxpr(j)[0] for j in jex_core.jaxprs_in_params(eqn.params)]


def walk_eqns(jaxpr: Any, enter: Callable[[Any], bool] = lambda _eqn: True) -> Iterator[Any]:
    """Every equation of a (closed) jaxpr and, for each equation `enter` accepts, of the jaxprs nested in
    it, depth first in program order (an equation comes before the equations nested in it)."""
    jaxpr, _ = as_jaxpr(jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        if enter(eqn):
            for sub in sub_jaxprs(eqn):
                yield from walk_eqns(sub, enter)


def outside_kernels(eqn: Any) -> bool:
    """A `walk_eqns` filter that does not enter pallas_call kernel bodies."""
    return eqn.primitive.name != "pallas_call"


def iter_pallas_eqns(jaxpr: Any) -> Iterator[Any]:
    """All pallas_call eqns in a (closed) jaxpr, at any depth outside kernels, in program order."""
    return (e for e in walk_eqns(jaxpr, outside_kernels) if e.primitive.name == "pallas_call")
