"""A traced JAX program flattened into a list of operations, ready to be written back out as source.

`torchax` hands us a jaxpr full of nested `jit` calls (one per torch op it lowers) and `custom_jvp_call`s
(jax.nn functions); a reader wants one straight-line function. `flatten` inlines those calls, drops
aliases (`copy`, `stop_gradient`: a forward reference has no gradients), folds dtype conversions of
literals, and removes dead code (torchax computes max-pool indices that nothing reads). Loops and window
reductions with a body (`scan`, `while`, `cond`, generic `reduce_window`) keep their body as a nested
`Program`.

`Program`s of the same model traced at two scales are compared op by op (`same_structure`): the source
writer needs both to tell a size that follows the inputs from a constant (`shape_fit`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

INLINED = (
    "pjit",
    "jit",
    "closed_call",
    "core_call",
    "custom_jvp_call",
    "custom_vjp_call",
    "remat",
    "checkpoint",
)
"""Call primitives whose body is spliced into the caller (all of them are pure function calls here)."""

ALIASES = ("copy", "copy_p", "stop_gradient", "optimization_barrier")
"""Primitives that return their operand unchanged in a forward computation."""

NESTED = {
    "scan": ("jaxpr",),
    "while": ("cond_jaxpr", "body_jaxpr"),
    "cond": ("branches",),
    "reduce_window": ("jaxpr",),
}
"""Primitives kept whole, their bodies flattened on their own (a loop body is emitted as a local def)."""


@dataclasses.dataclass(frozen=True)
class Ref:
    """A value: a variable (`var` set) or a literal constant (`value` set)."""

    var: int | None = None
    value: Any = None
    dtype: str = ""
    weak: bool = False

    @property
    def is_literal(self) -> bool:
        return self.var is None


@dataclasses.dataclass
class Op:
    prim: str
    ins: list[Ref]
    outs: list[int | None]
    params: dict[str, Any]
    origin: str = ""
    """Where the op came from in the user's code (`file.py:14  x = self.conv(x)`), when known."""
    bodies: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Nested programs (`Program` or a list of them for `cond` branches) by parameter name."""


@dataclasses.dataclass
class Program:
    invars: list[int]
    outs: list[Ref]
    ops: list[Op]
    avals: dict[int, tuple[tuple[int, ...], str]]
    """Shape and dtype of every variable."""
    consts: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    """Arrays the trace captured (closed-over tensors): emitted as literals when small, refused when not."""


class ProgramError(Exception):
    """The traced program cannot be written back out (a construct the writer does not take)."""


def _dtype(aval: Any) -> str:
    if not hasattr(aval, "dtype"):
        return ""
    try:
        return str(np.dtype(aval.dtype))
    except TypeError:  # an extended dtype (a PRNG key): named as JAX names it
        return str(aval.dtype)


def _shape(aval: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in getattr(aval, "shape", ()))


class _Flattener:
    def __init__(self, origin_of: Any) -> None:
        self.next_id = 0
        self.avals: dict[int, tuple[tuple[int, ...], str]] = {}
        self.consts: dict[int, np.ndarray] = {}
        self.origin_of = origin_of

    def new_var(self, aval: Any) -> int:
        vid = self.next_id
        self.next_id += 1
        self.avals[vid] = (_shape(aval), _dtype(aval))
        return vid

    def atom(self, env: dict[Any, Ref], a: Any) -> Ref:
        if hasattr(a, "val"):  # a Literal
            val = a.val
            aval = a.aval
            return Ref(value=np.asarray(val).item() if np.ndim(val) == 0 else np.asarray(val),
                       dtype=_dtype(aval), weak=bool(getattr(aval, "weak_type", False)))  # fmt: skip
        return env[a]

    def splice(self, jaxpr: Any, consts: list[Any], args: list[Ref], ops: list[Op]) -> list[Ref]:
        """Append `jaxpr`'s operations to `ops` with its inputs bound to `args`; return its outputs."""
        env: dict[Any, Ref] = {}
        for v, c in zip(jaxpr.constvars, consts, strict=True):
            vid = self.new_var(v.aval)
            try:
                self.consts[vid] = np.asarray(c)
            except TypeError as exc:  # a PRNG key captured by the trace
                raise ProgramError(f"captured a {_dtype(v.aval)} constant") from exc
            env[v] = Ref(var=vid)
        for v, a in zip(jaxpr.invars, args, strict=True):
            env[v] = a
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            ins = [self.atom(env, a) for a in eqn.invars]
            if name in INLINED:
                inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
                if inner is None:
                    raise ProgramError(f"a `{name}` call without a body")
                inner_jaxpr, inner_consts = (
                    (inner.jaxpr, inner.consts) if hasattr(inner, "consts") else (inner, [])
                )
                outs = self.splice(inner_jaxpr, list(inner_consts), ins, ops)
                for v, r in zip(eqn.outvars, outs, strict=True):
                    env[v] = r
                continue
            if name in ALIASES and len(ins) == len(eqn.outvars):
                for v, r in zip(eqn.outvars, ins, strict=True):
                    env[v] = r
                continue
            if name in ("mul", "div") and _is_one(ins[1]) and _same_aval(ins[0], eqn.outvars[0], self.avals):
                env[eqn.outvars[0]] = ins[0]  # torchax's `alpha * x` with alpha = 1
                continue
            if name == "convert_element_type" and ins[0].is_literal and np.ndim(ins[0].value) == 0:
                dt = str(np.dtype(eqn.params["new_dtype"]))
                env[eqn.outvars[0]] = Ref(value=np.asarray(ins[0].value).astype(dt).item(), dtype=dt,
                                          weak=bool(eqn.params.get("weak_type")))  # fmt: skip
                continue
            params = dict(eqn.params)
            bodies: dict[str, Any] = {}
            for key in NESTED.get(name, ()):
                value = params.pop(key)
                if isinstance(value, list | tuple):
                    bodies[key] = [flatten_closed(b, self.origin_of) for b in value]
                else:
                    bodies[key] = flatten_closed(value, self.origin_of)
            outs_ids: list[int | None] = []
            for v in eqn.outvars:
                if type(v).__name__ == "DropVar":
                    outs_ids.append(None)
                else:
                    vid = self.new_var(v.aval)
                    env[v] = Ref(var=vid)
                    outs_ids.append(vid)
            ops.append(Op(name, ins, outs_ids, params, self.origin_of(eqn), bodies))
        return [self.atom(env, a) for a in jaxpr.outvars]


def _is_one(r: Ref) -> bool:
    return r.is_literal and np.ndim(r.value) == 0 and r.value == 1 and not isinstance(r.value, bool)


def _same_aval(r: Ref, out: Any, avals: dict[int, tuple[tuple[int, ...], str]]) -> bool:
    return r.var is not None and avals[r.var] == (_shape(out.aval), _dtype(out.aval))


def flatten_closed(closed: Any, origin_of: Any = None) -> Program:
    """Flatten a ClosedJaxpr (or a bare Jaxpr) into a `Program`, dead code removed."""
    origin_of = origin_of or (lambda eqn: "")
    jaxpr, consts = (closed.jaxpr, list(closed.consts)) if hasattr(closed, "consts") else (closed, [])
    fl = _Flattener(origin_of)
    invars = [fl.new_var(v.aval) for v in jaxpr.invars]
    ops: list[Op] = []
    outs = fl.splice(jaxpr, consts, [Ref(var=i) for i in invars], ops)
    program = Program(invars=invars, outs=outs, ops=ops, avals=fl.avals, consts=fl.consts)
    return eliminate_dead_code(program)


EFFECTFUL = frozenset({"debug_callback", "io_callback"})


def eliminate_dead_code(program: Program) -> Program:
    live = {r.var for r in program.outs if r.var is not None}
    kept: list[Op] = []
    for op in reversed(program.ops):
        if op.prim in EFFECTFUL or any(o is not None and o in live for o in op.outs):
            kept.append(op)
            live.update(r.var for r in op.ins if r.var is not None)
    kept.reverse()
    consts = {k: v for k, v in program.consts.items() if k in live}
    return dataclasses.replace(program, ops=kept, consts=consts)


def primitives(program: Program) -> list[str]:
    names: list[str] = []
    for op in program.ops:
        names.append(op.prim)
        for body in op.bodies.values():
            for b in body if isinstance(body, list) else [body]:
                names.extend(primitives(b))
    return names


def structure_difference(a: Program, b: Program) -> str | None:
    """None when `a` and `b` are the same program up to sizes (ints that differ, in shapes and literals);
    else where they first differ, for the message."""
    if len(a.invars) != len(b.invars):
        return f"{len(a.invars)} inputs vs {len(b.invars)}"
    if len(a.ops) != len(b.ops):
        return f"{len(a.ops)} operations vs {len(b.ops)}"
    if len(a.outs) != len(b.outs):
        return f"{len(a.outs)} outputs vs {len(b.outs)}"
    for i, (x, y) in enumerate(zip(a.ops, b.ops, strict=True)):
        if x.prim != y.prim or len(x.ins) != len(y.ins) or len(x.outs) != len(y.outs):
            return f"operation {i}: {x.prim} vs {y.prim}"
        if set(x.params) != set(y.params):
            return f"operation {i} ({x.prim}): parameters differ"
        for key in x.params:
            if not _same_up_to_sizes(x.params[key], y.params[key]):
                return f"operation {i} ({x.prim}): parameter {key} {x.params[key]!r} vs {y.params[key]!r}"
        for rx, ry in zip(x.ins, y.ins, strict=True):
            if rx.is_literal != ry.is_literal or (rx.is_literal and rx.dtype != ry.dtype):
                return f"operation {i} ({x.prim}): operands differ"
        for key in x.bodies:
            bx, by = x.bodies[key], y.bodies[key]
            for p, q in zip(
                bx if isinstance(bx, list) else [bx], by if isinstance(by, list) else [by], strict=True
            ):
                inner = structure_difference(p, q)
                if inner:
                    return f"operation {i} ({x.prim}) body: {inner}"
    return None


def _same_up_to_sizes(p: Any, q: Any) -> bool:
    if isinstance(p, bool) or isinstance(q, bool):
        return p == q
    if isinstance(p, int) and isinstance(q, int):
        return True
    if isinstance(p, tuple | list) and isinstance(q, tuple | list):
        return len(p) == len(q) and all(_same_up_to_sizes(x, y) for x, y in zip(p, q, strict=True))
    try:
        return bool(p == q)
    except Exception:  # noqa: BLE001 - incomparable objects are compared by their text
        return repr(p) == repr(q)
