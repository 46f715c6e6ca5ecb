"""Trip counts and bodies of loops, so that both estimators charge a loop once per iteration.

Why this exists: the TPU compiler's cost model (``compiled.cost_analysis()``) prices the body of an HLO
``while`` loop *once*, whatever its trip count. Measured here (libtpu 0.0.42.1, v5e): the sliding-window
attention reference, a ``lax.map`` over 64 heads, reports 3.5e10 flops where the program does 2.2e12 -
exactly 64x less. Most attention references are written with ``lax.map`` / ``lax.scan`` / ``fori_loop``,
so without a correction their XLA time is under-priced by the trip count and every kernel looks slower
than it is against them. The block model had the mirror problem inside kernels: an in-kernel
``fori_loop`` whose bound depends on the grid position is a ``while`` in the kernel body, charged once.

What this module provides (plain functions of jaxprs and HLO text; no estimates of its own):

* :func:`hlo_while_trips` - the trip count of every ``while`` the compiler kept (its ``known_trip_count``
  annotation, else the bound its condition compares the induction variable with). XLA may unroll a
  loop fully (no ``while`` left, the cost model already sees every iteration) or partly (a ``while`` of
  ``L / u`` trips whose body holds ``u`` iterations); the estimator matches each jaxpr loop to a compiled
  one to know how many iterations the compiler's figure already contains.
* :func:`while_trip_count` - a jaxpr ``while``'s trip count when it has the counter form ``fori_loop``
  and most hand-written ``while_loop`` s have (a counter compared with a bound, stepped by a constant),
  from values the caller knows (literals, or per-grid-step vectors inside a kernel).
* :func:`loop_body_program` - a jaxpr loop's body as a standalone function plus argument specs, with the
  loop's data-independent constants (an iota mask built outside the loop) computed inside it as the
  compiler does after hoisting, so that the body is priced as it runs in the loop, not with a mask read
  from HBM that the real program never materialises.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.extend.core as jex_core
import numpy as np

from maxkernel.tools.jaxpr import as_jaxpr

LOOP_PRIMITIVES: frozenset[str] = frozenset({"scan", "while"})
"""Jaxpr primitives that lower to an HLO ``while`` (``fori_loop`` with static bounds becomes ``scan``)."""

# --------------------------------------------------------------------------------------------------------
# Compiled HLO: which loops the compiler kept, and their trip counts
# --------------------------------------------------------------------------------------------------------

_COMPUTATION_HEAD = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(")
_WHILE_COND = re.compile(r"\bwhile\(.*?condition=%?([\w.\-]+)")
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_SCALAR_CONST = re.compile(r"^\s*%([\w.\-]+)\s*=\s*[su](?:8|16|32|64)\[\][^ ]*\s+constant\((-?\d+)\)")
_COMPARE = re.compile(r"compare\(%([\w.\-]+),\s*%([\w.\-]+)\),\s*direction=(LT|LE|GT|GE|NE)")


def _computations(hlo: str) -> dict[str, list[str]]:
    """HLO module text split into computations: name -> body lines."""
    out: dict[str, list[str]] = {}
    name: str | None = None
    for line in hlo.splitlines():
        if name is None:
            m = _COMPUTATION_HEAD.match(line)
            if m and line.rstrip().endswith("{"):
                name = m.group(1)
                out[name] = []
        elif line.startswith("}"):
            name = None
        else:
            out[name].append(line)
    return out


def hlo_while_trips(hlo: str) -> list[int | None]:
    """Trip count of every ``while`` in a compiled HLO module, in text order (None: not readable).

    The count is the compiler's ``known_trip_count`` annotation when present; otherwise the integer
    constant the loop condition compares the induction variable with (JAX's loops count up from 0, so
    for ``LT`` that constant is the trip count). A loop whose condition has another shape is None.
    """
    comps = _computations(hlo)
    trips: list[int | None] = []
    for lines in comps.values():
        for line in lines:
            m = _WHILE_COND.search(line)
            if not m:
                continue
            known = _KNOWN_TRIPS.search(line)
            if known:
                trips.append(int(known.group(1)))
                continue
            trips.append(_condition_bound(comps.get(m.group(1), [])))
    return trips


_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_CALLED = re.compile(r"(?:calls|to_apply|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_WHILE_BODY = re.compile(r"\bwhile\(.*?body=%?([\w.\-]+)")


UNKNOWN_CYCLES: int = 1 << 60
"""`estimated_cycles` at or above this are the compiler's sentinel for "no estimate" (INT64_MAX-like values
were seen on a scatter-offload fusion): left out of both sums rather than drowning every other figure."""


@dataclass(frozen=True)
class LoopCycles:
    """The compiler's per-instruction ``estimated_cycles``, summed once (as its cost model prices the
    program) and weighted by the trip counts of the ``while`` loops around each instruction."""

    cycles_once: int
    cycles_per_trip: int
    trips: tuple[int | None, ...]
    """Trip count of each ``while`` reached from the entry computation (None: unreadable, counted once)."""
    loop_cycles_once: int
    """Cycles inside loop bodies, counted once: zero means the loops carry no cycle figures."""


def hlo_loop_cycles(hlo: str) -> LoopCycles:
    """Walk the compiled module from its entry computation, multiplying each ``while`` body's cycles by
    its trip count (nested loops multiply). Fusions, calls and branches inherit their caller's factor."""
    comps = _computations(hlo)
    entry = next(
        (
            m.group(1)
            for ln in hlo.splitlines()
            if ln.startswith("ENTRY") and (m := _COMPUTATION_HEAD.match(ln))
        ),
        None,
    )
    once = weighted = in_loops = 0
    trips: list[int | None] = []
    stack: list[tuple[str, int, bool, int]] = [(entry, 1, False, 0)] if entry in comps else []
    while stack:
        name, mult, in_loop, depth = stack.pop()
        if depth > 64:  # a malformed (cyclic) module: stop rather than loop forever
            continue
        for line in comps.get(name, []):
            c = _CYCLES.search(line)
            if c and int(c.group(1)) >= UNKNOWN_CYCLES:
                continue  # the compiler's "no estimate" sentinel (seen on scatter offload fusions)
            if c:
                once += int(c.group(1))
                weighted += int(c.group(1)) * mult
                in_loops += int(c.group(1)) if in_loop else 0
            body = _WHILE_BODY.search(line)
            if body:
                known = _KNOWN_TRIPS.search(line)
                cond = _WHILE_COND.search(line)
                n = (
                    int(known.group(1))
                    if known
                    else _condition_bound(comps.get(cond.group(1), []) if cond else [])
                )
                trips.append(n)
                stack.append((body.group(1), mult * (n if n else 1), True, depth + 1))
                continue
            called = _CALLED.findall(line)
            branches = _BRANCHES.search(line)
            if branches:
                called += re.findall(r"%?([\w.\-]+)", branches.group(1))
            for callee in called:
                if callee in comps and callee != name:
                    stack.append((callee, mult, in_loop, depth + 1))
    return LoopCycles(once, weighted, tuple(trips), in_loops)


def _condition_bound(lines: Sequence[str]) -> int | None:
    consts = {}
    for line in lines:
        c = _SCALAR_CONST.match(line)
        if c:
            consts[c.group(1)] = int(c.group(2))
    for line in lines:
        if "ROOT" not in line:
            continue
        m = _COMPARE.search(line)
        if not m:
            return None
        lhs, rhs, direction = m.groups()
        if direction == "LT" and rhs in consts:
            return max(0, consts[rhs])
        if direction == "LE" and rhs in consts:
            return max(0, consts[rhs] + 1)
        if direction == "GT" and lhs in consts:
            return max(0, consts[lhs])
        return None
    return None


def match_compiled_loop(length: int, pool: list[int | None]) -> int:
    """How many iterations of a jaxpr loop of `length` trips the compiler's cost model already priced.

    Takes the best matching compiled trip count out of `pool` (the module's remaining ``while`` trips):
    an exact match means the body (one iteration) was priced once; a count ``n`` dividing `length` means
    the compiler unrolled by ``length / n`` and priced that many iterations; no match means the loop was
    unrolled completely (or removed) and every iteration is already in the compiler's figure.
    """
    if length in pool:
        pool.remove(length)
        return 1
    for n in sorted((t for t in pool if t is not None and t > 1 and length % t == 0), reverse=True):
        pool.remove(n)
        return length // n
    return length


# --------------------------------------------------------------------------------------------------------
# Jaxpr loops: trip counts
# --------------------------------------------------------------------------------------------------------

_COUNTER_COMPARE = frozenset({"lt", "le", "gt", "ge", "ne"})


@dataclass(frozen=True)
class CounterLoop:
    """A ``while`` in counter form: carry[counter] steps by `step` until `compare` with the bound fails."""

    counter: int
    """Carry position of the induction variable."""
    step: int
    compare: str
    bound: tuple[str, Any]
    """("carry", position) for a loop-invariant carry, ("const", cond-const position) or ("literal", v)."""
    counter_on_left: bool


def counter_loop(eqn: jex_core.JaxprEqn) -> CounterLoop | None:
    """The counter form of a jaxpr ``while``, or None when its condition or step is anything else."""
    cond, _ = as_jaxpr(eqn.params["cond_jaxpr"])
    body, _ = as_jaxpr(eqn.params["body_jaxpr"])
    n_cc = int(eqn.params["cond_nconsts"])
    n_bc = int(eqn.params["body_nconsts"])
    if len(cond.eqns) != 1 or cond.eqns[0].primitive.name not in _COUNTER_COMPARE:
        return None
    cmp = cond.eqns[0]
    if cmp.outvars[0] is not cond.outvars[0]:
        return None
    carry_in = cond.invars[n_cc:]
    a, b = cmp.invars

    def where(v: Any) -> tuple[str, Any] | None:
        if isinstance(v, jex_core.Literal):
            return ("literal", v.val)
        if v in carry_in:
            return ("carry", carry_in.index(v))
        if v in cond.invars[:n_cc]:
            return ("const", cond.invars.index(v))
        return None

    wa, wb = where(a), where(b)
    if wa is None or wb is None:
        return None
    for counter_side, (wc, wbound) in ((True, (wa, wb)), (False, (wb, wa))):
        if wc[0] != "carry":
            continue
        step = _counter_step(body, n_bc, wc[1])
        if step is None:
            continue
        if wbound[0] == "carry" and not _passes_through(body, n_bc, wbound[1]):
            continue
        return CounterLoop(wc[1], step, cmp.primitive.name, wbound, counter_side)
    return None


def _counter_step(body: jex_core.Jaxpr, n_bc: int, pos: int) -> int | None:
    """The constant step of carry[pos] (out = in + c / in - c / c + in), None otherwise."""
    v_in, v_out = body.invars[n_bc + pos], body.outvars[pos]
    for e in body.eqns:
        if v_out in e.outvars and e.primitive.name in ("add", "sub"):
            x, y = e.invars
            if x is v_in and isinstance(y, jex_core.Literal):
                return int(y.val) if e.primitive.name == "add" else -int(y.val)
            if y is v_in and isinstance(x, jex_core.Literal) and e.primitive.name == "add":
                return int(x.val)
    return None


def _passes_through(body: jex_core.Jaxpr, n_bc: int, pos: int) -> bool:
    return body.outvars[pos] is body.invars[n_bc + pos]


def while_trip_count(eqn: jex_core.JaxprEqn, value: Callable[[Any], Any]) -> np.ndarray | None:
    """Trip count(s) of a counter-form ``while`` from the values `value(var)` knows (a scalar, or one
    value per grid step inside a kernel); None when the loop is not in counter form or a needed value is
    unknown (`value` raising KeyError)."""
    form = counter_loop(eqn)
    if form is None:
        return None
    n_cc = int(eqn.params["cond_nconsts"])
    n_bc = int(eqn.params["body_nconsts"])
    carry_init = eqn.invars[n_cc + n_bc :]
    try:
        init = np.asarray(value(carry_init[form.counter]), np.int64)
        kind, where = form.bound
        if kind == "literal":
            bound = np.asarray(where, np.int64)
        elif kind == "carry":
            bound = np.asarray(value(carry_init[where]), np.int64)
        else:
            bound = np.asarray(value(eqn.invars[where]), np.int64)
    except (KeyError, TypeError, ValueError):
        return None
    step = form.step
    cmp = form.compare
    if not form.counter_on_left:  # bound OP counter  ==  counter OP' bound
        cmp = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "ne": "ne"}[cmp]
    span = bound - init
    if cmp == "lt" and step > 0:
        trips = -(-span // step)
    elif cmp == "le" and step > 0:
        trips = span // step + 1
    elif cmp == "gt" and step < 0:
        trips = -(span // -step)
    elif cmp == "ge" and step < 0:
        trips = (-span) // -step + 1
    elif cmp == "ne" and step != 0 and np.all(span % step == 0) and np.all(span // step >= 0):
        trips = span // step
    else:
        return None
    return np.maximum(trips, 0)


def literal_value(v: Any) -> Any:
    """`value` for :func:`while_trip_count` outside kernels: literals only (KeyError otherwise)."""
    if isinstance(v, jex_core.Literal):
        return v.val
    raise KeyError(v)


def jaxpr_loop_trips(eqn: jex_core.JaxprEqn, value: Callable[[Any], Any] = literal_value) -> int | None:
    """Static trip count of a jaxpr loop eqn (``scan`` length, counter-form ``while``), else None."""
    if eqn.primitive.name == "scan":
        return int(eqn.params["length"])
    trips = while_trip_count(eqn, value)
    if trips is None or np.ndim(trips):
        return None
    return int(trips)


# --------------------------------------------------------------------------------------------------------
# Jaxpr loops: the body as a program of its own
# --------------------------------------------------------------------------------------------------------


def _data_independent(jaxpr: jex_core.Jaxpr) -> set[Any]:
    """Vars of `jaxpr` computed from literals and closed-over constants only (iotas, masks built from
    them), through effect-free equations that contain no loops."""
    free: set[Any] = set(jaxpr.constvars)
    for e in jaxpr.eqns:
        if e.effects or e.primitive.name in LOOP_PRIMITIVES or e.primitive.name == "pallas_call":
            continue
        if all(isinstance(v, jex_core.Literal) or v in free for v in e.invars):
            free.update(e.outvars)
    return free


def _producer_slice(jaxpr: jex_core.Jaxpr, wanted: Sequence[Any]) -> list[jex_core.JaxprEqn]:
    """The equations `wanted` vars depend on, in program order."""
    need = {v for v in wanted if not isinstance(v, jex_core.Literal)}
    keep: list[jex_core.JaxprEqn] = []
    for e in reversed(jaxpr.eqns):
        if any(o in need for o in e.outvars):
            keep.append(e)
            need.update(v for v in e.invars if not isinstance(v, jex_core.Literal))
    return keep[::-1]


def loop_body_program(
    outer: jex_core.ClosedJaxpr | jex_core.Jaxpr,
    outer_consts: Sequence[Any],
    eqn: jex_core.JaxprEqn,
) -> tuple[Callable[..., Any], list[jax.ShapeDtypeStruct]]:
    """One iteration of loop `eqn` (a scan or while of the jaxpr `outer`) as a function and its arg specs.

    The body's arguments are the loop's per-iteration operands (carry, the slices of scanned inputs) and
    its constants. Constants the outer program computes from literals alone are recomputed inside the
    function - the compiler does the same to the real loop (it sinks such constants into the body) - so
    the body is not charged an HBM read of a mask that never exists in HBM.
    """
    jaxpr, _ = as_jaxpr(outer)
    if eqn.primitive.name == "scan":
        body = eqn.params["jaxpr"]
        n_consts = int(eqn.params["num_consts"])
        outer_args = list(eqn.invars)
    else:
        body = eqn.params["body_jaxpr"]
        n_consts = int(eqn.params["body_nconsts"])
        outer_args = list(eqn.invars[int(eqn.params["cond_nconsts"]) :])
    body_jaxpr, _ = as_jaxpr(body)
    closed_body = body if isinstance(body, jex_core.ClosedJaxpr) else jex_core.ClosedJaxpr(body, [])
    free = _data_independent(jaxpr)
    inline: dict[int, Any] = {}
    for i, v in enumerate(outer_args[:n_consts]):
        if isinstance(v, jex_core.Literal) or v in free:
            inline[i] = v
    fetch_vars = [v for v in inline.values() if not isinstance(v, jex_core.Literal)]
    sub = None
    if fetch_vars:
        eqns = _producer_slice(jaxpr, fetch_vars)
        sub = jaxpr.replace(invars=[], outvars=list(fetch_vars), eqns=eqns, debug_info=None)
    arg_positions = [i for i in range(len(body_jaxpr.invars)) if i not in inline]
    specs = [
        jax.ShapeDtypeStruct(tuple(body_jaxpr.invars[i].aval.shape), body_jaxpr.invars[i].aval.dtype)
        for i in arg_positions
    ]

    def one_iteration(*args: Any) -> Any:
        computed = jax.core.eval_jaxpr(sub, list(outer_consts)) if sub is not None else []
        by_var = dict(zip(fetch_vars, computed, strict=True))
        full: list[Any] = [None] * len(body_jaxpr.invars)
        for i, v in inline.items():
            full[i] = v.val if isinstance(v, jex_core.Literal) else by_var[v]
        for i, a in zip(arg_positions, args, strict=True):
            full[i] = a
        return jex_core.jaxpr_as_fun(closed_body)(*full)

    return one_iteration, specs


def loop_eqns(
    jaxpr: jex_core.Jaxpr, consts: Sequence[Any] = ()
) -> list[tuple[jex_core.Jaxpr, Sequence[Any], jex_core.JaxprEqn]]:
    """Loops at the top of a program, through call wrappers (pjit, closed_call, custom_jvp/vjp) but not
    into loop bodies (nested loops are their body's business), conds or kernels: (enclosing jaxpr, its
    consts, eqn) triples."""
    out: list[tuple[jex_core.Jaxpr, Sequence[Any], jex_core.JaxprEqn]] = []
    for e in jaxpr.eqns:
        name = e.primitive.name
        if name in LOOP_PRIMITIVES:
            out.append((jaxpr, consts, e))
        elif name in ("pallas_call", "cond"):
            continue
        else:
            for sub in jex_core.jaxprs_in_params(e.params):
                out.extend(loop_eqns(*as_jaxpr(sub)))
    return out
