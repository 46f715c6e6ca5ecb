"""Trace a reference into one flat jaxpr per input configuration, and line the traces up. Worker side only.

The reference is traced with abstract inputs (`jax.ShapeDtypeStruct`): nothing is allocated and no task
code runs outside the sandbox. Flattening re-traces the jaxpr through a small interpreter that

* inlines calls (`jit`, `custom_jvp_call`, `custom_vjp_call`, `closed_call`, `remat`), so the analysis
  sees one list of primitives;
* turns a carry-free `scan` (what `lax.map` produces) into a `vmap` of its body: the iterations are
  independent, so the batched body is the same computation with a batch dimension the kernels can grid
  over;
* drops equations whose results are never used.

The same reference is traced at every configuration the task has (its TPU shapes and its validation
shapes). The traces must have the same structure; where they differ only in numbers (shapes, literals),
those numbers depend on the inputs' shapes or the static arguments, and `Resolver` finds the expression
that produces them so the generated kernel derives them instead of hard-coding one configuration's value.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from maxkernel.authors.offline import threefry
from maxkernel.authors.offline.head_groups import HeadGroups
from maxkernel.authors.offline.linear_sums import ShiftedSums
from maxkernel.authors.offline.moments import OnePassMoments
from maxkernel.authors.offline.split_contractions import SplitContractions
from maxkernel.tools.jaxpr import CALL_PRIMITIVES, walk_eqns

REWRITTEN: set[str] = set()
"""Primitives the last `trace_reference` rewrote into others (a convolution into patches + matmul)."""


class Unsupported(Exception):
    """The reference uses something the offline author cannot turn into a kernel; the message says what."""


def _as_closed(j: Any) -> tuple[Any, list[Any]]:
    if hasattr(j, "jaxpr") and hasattr(j, "consts"):
        return j.jaxpr, list(j.consts)
    return j, []


CONST_OPS = frozenset(
    """iota broadcast_in_dim convert_element_type reshape squeeze expand_dims transpose add sub mul div neg
    max min exp exp2 log log1p eq ne lt le gt ge and or not select_n abs floor ceil sqrt rsqrt integer_pow pow
    rem sign""".split()
)
"""Ops on constants (iotas and literals) that are re-emitted for every use: a mask built from one
`arange` used along two axes (`pos[:, None] >= pos[None, :]`) must not tie those axes together."""


def _eval(
    jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], arg_facts: Sequence[str | None] | None = None
) -> list[Any]:
    """Re-trace `jaxpr` with the rewrites of `_apply`. `arg_facts`: what is known of each argument's value
    beyond its type ("arange": a 1-D iota; "zeros": all zeros; "input": a program input; "below:N": integers
    in [0, N)), which a call's body inherits."""
    env: dict[Any, Any] = {}
    thunks: dict[Any, Callable[[], Any]] = {}
    facts: dict[Any, str] = {}  # vars whose value is known: "arange" (1-D iota) or "zeros"

    def fact_of(v: Any) -> str | None:
        return None if isinstance(v, jcore.Literal) else facts.get(v)

    def read(v: Any) -> Any:
        if isinstance(v, jcore.Literal):
            return v.val
        if v in thunks:
            return thunks[v]()
        return env[v]

    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = c
    for v, a in zip(jaxpr.invars, args, strict=True):
        env[v] = a
    for v, f in zip(jaxpr.invars, arg_facts or [None] * len(args), strict=True):
        if f is not None:
            facts[v] = f
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    concrete_memo: dict[Any, Any] = {}
    dilated: dict[
        Any, tuple[Any, list[tuple[int, int, int]]]
    ] = {}  # zero-dilated value -> (input, pad config)

    def concrete(v: Any) -> np.ndarray | None:
        """The value of `v` when it is computed from literals alone (an index table built with iotas)."""
        if isinstance(v, jcore.Literal):
            return np.asarray(v.val)
        if v not in concrete_memo:
            concrete_memo[v] = None
            e = producer.get(v)
            if (
                e is not None
                and (e.primitive.name in CONST_OPS or e.primitive.name == "concatenate")
                and len(e.outvars) == 1
                and math.prod(e.outvars[0].aval.shape) <= CONCRETE_MAX_ELEMS
            ):
                ins = [concrete(w) for w in e.invars]
                if all(x is not None for x in ins):
                    with jax.ensure_compile_time_eval():
                        concrete_memo[v] = np.asarray(e.primitive.bind(*ins, **e.params))
        return concrete_memo[v]

    casts = _CastMotion(jaxpr)
    outer = _OuterBroadcasts()
    moments = OnePassMoments(jaxpr, _one_pass_moments_decision)
    shifted = ShiftedSums(jaxpr)
    contractions = SplitContractions(jaxpr)
    heads = HeadGroups(jaxpr, read, lambda choose: SIZE_DECISIONS.decide("head_groups", choose))
    for eqn in jaxpr.eqns:
        if heads.active:
            grouped = heads.apply(eqn)
            if grouped is not None:
                env[eqn.outvars[0]] = grouped[0]
                continue
        split = outer.apply(eqn, read, fact_of)
        if split is None:
            split = moments.apply(eqn, read)
        if split is None:
            split = shifted.apply(eqn, read)
        if split is None:
            split = contractions.apply(eqn, read)
        if split is None:
            split = _fold_scalar(
                eqn, [read(v) if isinstance(v, jcore.Literal) or v in env else None for v in eqn.invars]
            )
        if split is not None:
            env[eqn.outvars[0]] = split
            continue
        for v, known in zip(eqn.outvars, _result_facts(eqn, [fact_of(v) for v in eqn.invars]), strict=False):
            if known is not None:
                facts[v] = known
        moved = casts.apply(eqn, read)
        if moved is not None:
            env[eqn.outvars[0]] = moved
            continue
        deferrable = (
            eqn.primitive.name in CONST_OPS
            and len(eqn.outvars) == 1
            and all(isinstance(v, jcore.Literal) or v in thunks for v in eqn.invars)
        )
        if deferrable:
            thunks[eqn.outvars[0]] = _thunk(eqn, read)
            continue
        if (
            eqn.primitive.name in ("scatter", "scatter-add", "scatter_add")
            and fact_of(eqn.invars[0]) == "zeros"
        ):
            idx = concrete(eqn.invars[1])
            grid = None if idx is None else _scatter_into_zeros_as_pad(eqn, read(eqn.invars[2]), idx)
            if grid is not None:
                REWRITTEN.add("scatter_into_zeros")
                dilated[eqn.outvars[0]] = grid
                env[eqn.outvars[0]] = jax.lax.pad(grid[0], np.zeros((), grid[0].dtype), grid[1])
                continue
        if eqn.primitive.name == "pad" and (
            fact_of(eqn.invars[1]) == "zeros"
            or (isinstance(eqn.invars[1], jcore.Literal) and eqn.invars[1].val == 0)
        ):
            config = [tuple(int(c) for c in p) for p in eqn.params["padding_config"]]
            if any(c[2] for c in config):
                dilated[eqn.outvars[0]] = (read(eqn.invars[0]), config)
        if eqn.primitive.name == "conv_general_dilated" and eqn.invars[0] in dilated:
            x, config = dilated[eqn.invars[0]]
            conv = _dilated_conv(eqn, x, config, read(eqn.invars[1]))
            if conv is not None:
                REWRITTEN.add("transposed_conv")
                env[eqn.outvars[0]] = conv
                continue
        ins = [read(v) for v in eqn.invars]
        outs = _apply(eqn, ins, [fact_of(v) for v in eqn.invars])
        for v, o in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, jcore.DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


SCALAR_FOLDS: dict[str, Callable[..., Any]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "max": np.maximum,
    "min": np.minimum,
    "neg": np.negative,
    "gt": np.greater,
    "ge": np.greater_equal,
    "lt": np.less,
    "le": np.less_equal,
    "eq": np.equal,
    "ne": np.not_equal,
}


def _fold_scalar(eqn: Any, ins: list[Any]) -> Any | None:
    """A scalar known at trace time, computed now: `jnp.var`'s divisor `n - ddof` and its guard
    `select(n - ddof > 0, var, nan)` leave no equation whose literal (the reduced count) a kernel would have
    to name from the shapes. `ins`: the operands' values, None for a value not yet known here. A `select_n`
    whose predicate is such a scalar is the case it picks. Float and boolean results only (integer division
    and overflow keep their `lax` semantics in the program)."""
    name = eqn.primitive.name
    known = [x if isinstance(x, (np.ndarray, np.generic, bool, int, float)) else None for x in ins]
    if name == "select_n" and known[0] is not None and np.ndim(known[0]) == 0 and len(eqn.outvars) == 1:
        pick = ins[1 + int(known[0])]
        return pick if tuple(np.shape(pick)) == tuple(eqn.outvars[0].aval.shape) else None
    if len(eqn.outvars) != 1 or eqn.outvars[0].aval.shape != () or any(x is None for x in known):
        return None
    if not all(isinstance(v.aval.dtype, np.dtype) for v in [*eqn.invars, *eqn.outvars]):
        return None  # an extended type (a PRNG key)
    dtype = np.dtype(eqn.outvars[0].aval.dtype)
    if not (np.issubdtype(dtype, np.floating) or dtype == np.bool_):
        return None
    if name == "div":
        fold = np.divide
    elif name == "convert_element_type":
        fold = np.asarray
    else:
        fold = SCALAR_FOLDS.get(name)
    if fold is None:
        return None
    with np.errstate(all="ignore"):
        return np.asarray(
            fold(*[np.asarray(x, np.dtype(v.aval.dtype)) for x, v in zip(known, eqn.invars, strict=True)])
        ).astype(dtype)


class _OuterBroadcasts:
    """A 1-D integer vector broadcast along two different axes (`seg[:, None] == seg[None, :]`, the
    same-segment mask of ragged attention) would tie the two axes together in the partition's axis classes,
    though one is the query axis and the other the key axis. The second way of broadcasting it reads a
    copy of the vector instead (a full-range slice: layout glue, a few KiB), so each axis gets its own
    operand and a kernel reads one block of it per query block and one per key block."""

    def __init__(self) -> None:
        self.first: dict[Any, tuple[int, ...]] = {}

    def apply(self, eqn: Any, read: Callable[[Any], Any], fact_of: Callable[[Any], str | None]) -> Any | None:
        if eqn.primitive.name != "broadcast_in_dim" or isinstance(eqn.invars[0], jcore.Literal):
            return None
        if fact_of(eqn.invars[0]) is not None:
            return None  # an iota (positions) is re-emitted in the kernel per block: no operand to tie
        src = eqn.invars[0]
        if len(src.aval.shape) != 1 or not np.issubdtype(np.dtype(src.aval.dtype), np.integer):
            return None
        dims = tuple(int(d) for d in eqn.params["broadcast_dimensions"])
        if len(eqn.outvars[0].aval.shape) < 2:
            return None
        seen = self.first.setdefault(src, dims)
        if seen == dims:
            return None
        from jax import lax

        x = read(src)
        copy = lax.slice(x, (0,), (x.shape[0],))
        return lax.broadcast_in_dim(copy, eqn.params["shape"], dims)


LAYOUT_OPS = frozenset({"slice", "concatenate", "reshape", "transpose", "squeeze", "expand_dims", "rev"})
"""Primitives that only move elements: a float cast commutes with them exactly."""


def _float_cast(eqn: Any) -> tuple[Any, Any] | None:
    """(from, to) dtypes of a float-to-float `convert_element_type` of a variable, else None."""
    if eqn.primitive.name != "convert_element_type" or isinstance(eqn.invars[0], jcore.Literal):
        return None
    src, dst = np.dtype(eqn.invars[0].aval.dtype), np.dtype(eqn.outvars[0].aval.dtype)
    floating = all(jax.numpy.issubdtype(d, jax.numpy.floating) for d in (src, dst))
    return (src, dst) if floating and src != dst else None


class _CastMotion:
    """Moves float casts across layout glue so the layout ops outside kernels move the narrow dtype and
    the casts land next to the arithmetic, inside kernels:

    * widening: `slice(convert_f32(x_bf16))` becomes `convert_f32(slice(x_bf16))`: the slice copies bf16,
      and the cast fuses into the kernel that reads it (rotate-half: `x.astype(f32)[..., :half]`);
    * narrowing: `convert_bf16(concatenate(a_f32, b_f32))`, when the cast is the layout result's only use,
      becomes `concatenate(convert_bf16(a), convert_bf16(b))`: each kernel writes bf16, and the concatenate
      copies half the bytes.

    Both are exact: a cast is elementwise, and layout ops only move elements."""

    def __init__(self, jaxpr: Any) -> None:
        uses: dict[Any, int] = {}
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                if not isinstance(v, jcore.Literal):
                    uses[v] = uses.get(v, 0) + 1
        for v in jaxpr.outvars:
            if not isinstance(v, jcore.Literal):
                uses[v] = uses.get(v, 0) + 1
        producer = {v: e for e in jaxpr.eqns for v in e.outvars}
        self.narrow_to: dict[Any, Any] = {}  # layout result var -> the dtype its only use casts it to
        for eqn in jaxpr.eqns:
            cast = _float_cast(eqn)
            src = producer.get(eqn.invars[0]) if cast else None
            if (
                cast is not None
                and src is not None
                and src.primitive.name in LAYOUT_OPS
                and uses.get(eqn.invars[0]) == 1
                and cast[1].itemsize < cast[0].itemsize
            ):
                self.narrow_to[eqn.invars[0]] = cast[1]
        self.wide_of: dict[Any, Any] = {}  # var -> the narrow value it is a widening cast of
        self.narrowed: set[Any] = set()  # layout results computed already in their cast's dtype

    def apply(self, eqn: Any, read: Callable[[Any], Any]) -> Any | None:
        """The equation's single result computed with a moved cast, or None to evaluate it as usual."""
        from jax import lax

        name = eqn.primitive.name
        cast = _float_cast(eqn)
        if cast is not None:
            v = eqn.invars[0]
            if v in self.narrowed:  # its operand was made in this dtype already
                return read(v)
            if cast[1].itemsize > cast[0].itemsize:
                self.wide_of[eqn.outvars[0]] = read(v)
            return None
        if name not in LAYOUT_OPS or len(eqn.outvars) != 1:
            return None
        out = eqn.outvars[0]
        ins = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
        if not ins or len(ins) != len(eqn.invars):
            return None
        to = self.narrow_to.get(out)
        if to is not None:
            self.narrowed.add(out)
            return _apply(eqn, [lax.convert_element_type(read(v), to) for v in ins])[0]
        if all(v in self.wide_of for v in ins):
            narrow = [self.wide_of[v] for v in ins]
            if len({np.dtype(x.dtype) for x in narrow}) == 1:
                moved = _apply(eqn, narrow)[0]
                self.wide_of[out] = moved
                return lax.convert_element_type(moved, np.dtype(out.aval.dtype))
        return None


def _result_facts(eqn: Any, in_facts: list[str | None]) -> list[str | None]:
    """What is known of each of an equation's results: `_value_fact` for one result, and the bound of the
    indices `top_k` returns ("below:N": integers in [0, N), N the length of the axis it picked from)."""
    if eqn.primitive.name == "top_k" and len(eqn.outvars) == 2:
        axis = int(eqn.params.get("axis", -1))
        return [None, f"below:{int(eqn.invars[0].aval.shape[axis])}"]
    return [_value_fact(eqn, in_facts)]


def _value_fact(eqn: Any, in_facts: list[str | None]) -> str | None:
    """What is known of an equation's single result from its kind and its operands' facts."""
    name = eqn.primitive.name
    if len(eqn.outvars) != 1:
        return None
    if name == "iota" and len(eqn.outvars[0].aval.shape) == 1:
        return "arange"
    if name == "broadcast_in_dim" and isinstance(eqn.invars[0], jcore.Literal):
        return "zeros" if np.all(np.asarray(eqn.invars[0].val) == 0) else None
    if name in ("broadcast_in_dim", "convert_element_type", "reshape") and in_facts[:1] == ["zeros"]:
        return "zeros"
    if name in ("argmax", "argmin"):
        axis = int(eqn.params["axes"][0])
        return f"below:{int(eqn.invars[0].aval.shape[axis])}"
    below = in_facts[0] if in_facts and in_facts[0] and in_facts[0].startswith("below:") else None
    if below and name in ("reshape", "copy", "copy_p", "squeeze", "expand_dims", "broadcast_in_dim"):
        return below
    if below and name == "convert_element_type" and np.issubdtype(eqn.outvars[0].aval.dtype, np.integer):
        n = int(below.split(":")[1])
        return below if n - 1 <= np.iinfo(eqn.outvars[0].aval.dtype).max else None
    if name == "convert_element_type" and in_facts[:1] == ["input"]:
        # a cast of an input is still read in place by a gather (the cast moves after it, onto the picked
        # elements): a take_along_axis of `logits.astype(f32)` stays one small gather of the bf16 input
        return "input"
    return None


def _thunk(eqn: Any, read: Callable[[Any], Any]) -> Callable[[], Any]:
    def run() -> Any:
        return _apply(eqn, [read(v) for v in eqn.invars])[0]

    return run


def _apply(eqn: Any, ins: list[Any], in_facts: list[str | None] | None = None) -> list[Any]:
    """One equation on traced values, with the rewrites above; `in_facts`: what is known of each operand's
    value (see `_eval`)."""
    name = eqn.primitive.name
    in_facts = in_facts or [None] * len(ins)
    if name in CALL_PRIMITIVES and eqn.params.get("name") == "searchsorted":
        side = _searchsorted_side(eqn)
        if side is not None:
            REWRITTEN.add("searchsorted")
            out = _searchsorted_as_count(ins[0], ins[1], side, eqn.outvars[0].aval.dtype)
            sizes = GROUPS.get(ins[0], "ends")
            if sizes is not None and side == "right" and in_facts[1] == "arange":
                GROUPS.put(out, ("row_group", sizes[1], 0))
            return [out]
    if name in CALL_PRIMITIVES:
        key = CALL_PRIMITIVES[name]
        sub = eqn.params.get(key)
        if sub is None:  # a parameter spelling this JAX version uses that the table does not know
            sub = next(v for v in eqn.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr"))
        inner, consts = _as_closed(sub)
        return _eval(inner, consts, ins, in_facts)
    if name == "scan" and eqn.params["num_carry"] == 0:
        return _scan_as_vmap(eqn, ins, in_facts)
    if name == "stop_gradient":
        return [ins[0]]
    if name in WINDOW_REDUCTIONS and _pool_splits(eqn):
        REWRITTEN.add(name)
        return [_pool_as_split(ins[0], eqn)]
    if name == "conv_general_dilated" and any(int(d) != 1 for d in eqn.params.get("lhs_dilation") or ()):
        REWRITTEN.add("transposed_conv")
        return [_transposed_conv_as_phases(ins[0], ins[1], eqn.params)]
    if name == "conv_general_dilated":
        return [_conv(ins[0], ins[1], eqn.params)]
    if name == "sort":
        REWRITTEN.add(name)
        bound = in_facts[0][len("below:") :] if in_facts[0] and in_facts[0].startswith("below:") else None
        return _sort_as_rank(
            eqn, ins, [f == "arange" for f in in_facts], key_bound=int(bound) if bound else None
        )
    if name in ("scatter", "scatter-add", "scatter_add") and len(ins) == 3:
        REWRITTEN.add(name)
        rank = PERMUTATIONS.rank_of(ins[1])
        if rank is not None:
            return [_scatter_by_permutation(*ins, rank, eqn.params, add=name != "scatter")]
        return [_scatter_as_masked_reduce(*ins, eqn.params, add=name != "scatter")]
    if name in CUMULATIVE:
        REWRITTEN.add(name)
        out = _cumulative_as_masked_reduce(ins[0], name, int(eqn.params["axis"]), bool(eqn.params["reverse"]))
        if name == "cumsum" and ins[0].ndim == 1 and not eqn.params["reverse"] and ins[0].dtype == np.int32:
            GROUPS.put(out, ("ends", ins[0]))
        return [out]
    if name == "gather" and in_facts[0] != "input" and _is_take_along_rows(eqn, ins):
        REWRITTEN.add("take_along_axis")
        return [_take_along_rows_as_masked_sum(eqn, ins)]
    if name == "random_bits" and threefry.rewritable(ins[0], eqn.params):
        REWRITTEN.add(name)
        return [threefry.threefry_bits(ins[0], tuple(eqn.params["shape"]))]
    if name in UNIT_REDUCTIONS and ins[0].ndim and all(ins[0].shape[a] == 1 for a in eqn.params["axes"]):
        REWRITTEN.add("unit_reduction")
        return [jax.lax.reshape(ins[0], tuple(eqn.outvars[0].aval.shape))]
    if name == "dot_general":
        ragged = GROUPS.ragged_dot(eqn, ins)
        if ragged is not None:
            REWRITTEN.add("ragged_dot_general")
            return [ragged]
        weighted = _weighted_sum_side(eqn, ins, in_facts)
        if weighted is not None:
            REWRITTEN.add("weighted_sum")
            return [_dot_as_weighted_sum(eqn, ins, weighted)]
    out = eqn.primitive.bind(*ins, **eqn.params)
    outs = list(out) if eqn.primitive.multiple_results else [out]
    PERMUTATIONS.follow(eqn, ins, outs)
    GROUPS.follow(eqn, ins, outs, in_facts)
    return outs


UNIT_REDUCTIONS = frozenset(
    {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or"}
)
"""Reductions rewritten as a reshape when every reduced axis has size 1 (`x.sum(-1)` over a [M, 1] matmul
result: a linear layer with one output, a gate): nothing is summed, and a reduction starts a region of its
own where a reshape is layout the producer's kernel absorbs (26k's matmul and its epilogue became one
kernel instead of two)."""

CUMULATIVE = {"cumsum": "sum", "cummax": "max", "cummin": "min"}
"""Cumulative ops rewritten as a masked reduction over a square of the scanned axis (see below)."""

CUMULATIVE_MAX_LEN = 4096
"""Most chunks in the two-level rewrite (the chunk totals are scanned as one masked reduction)."""

CUMULATIVE_MULTI_DIM_LEN = 512
"""Longest scanned axis of a multi-dim scan kept as one masked reduction (a chunked SSD's within-chunk cumsum
of 64 to 256); a longer one (a cumulative log-decay over a whole 4096-long sequence, per batch and head) is
scanned in chunks: its n^2 masked work per row is estimated at 9 ms of VPU and EUP time on v5e at
[4, 64, 4096]."""

CUMULATIVE_CHUNK = 128
"""Longest axis scanned as one masked reduction: each output element reads the whole axis (n² work), cheap
for chunk-sized axes and group counts; a longer axis is scanned in chunks of this many elements."""


def _cumulative_as_masked_reduce(x: Any, name: str, axis: int, reverse: bool) -> Any:
    """`cumsum(x, axis)[.., i, ..] = sum_j x[.., j, ..] * (j <= i)`: a broadcast, an iota mask and a
    reduction, which the kernel families already fuse into the kernel that produces or consumes `x` (a
    prefix sum has no TPU vector primitive; a masked reduction over a VMEM-resident axis does).

    A 1-D scan longer than CUMULATIVE_CHUNK (segment ids / offsets: `jnp.repeat` over 8192 tokens), or any
    scan longer than CUMULATIVE_MAX_LEN, runs in two levels (`_cumulative_in_chunks`): n x c + (n/c)^2 work
    instead of n^2. The task's own shapes decide, and the validation shapes replay the choice
    (`SIZE_DECISIONS`), so a scan of 64 at validation and 2048 on the TPU is one program; a multi-dim scan
    (a chunked SSD's within-chunk cumsum) keeps the one-level form up to the old limit."""
    n = x.shape[axis]
    if SIZE_DECISIONS.decide(
        "chunked_scan", lambda: n > (CUMULATIVE_CHUNK if x.ndim == 1 else CUMULATIVE_MULTI_DIM_LEN)
    ):
        return _cumulative_in_chunks(x, name, axis, reverse)
    return _masked_prefix(x, name, axis, reverse, strict=False)


def _identity_of(x: Any, name: str) -> Any:
    """The value a cumulative `name` ignores (0 for a sum, the dtype's lowest for a max, highest for a min)."""
    import jax.numpy as jnp

    if name == "cumsum":
        return np.zeros((), x.dtype)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return np.asarray(-np.inf if name == "cummax" else np.inf, x.dtype)
    info = jnp.iinfo(x.dtype)
    return np.asarray(info.min if name == "cummax" else info.max, x.dtype)


def _masked_prefix(x: Any, name: str, axis: int, reverse: bool, *, strict: bool) -> Any:
    """The masked-reduction prefix along `axis` (inclusive, or exclusive when `strict`)."""
    import jax.numpy as jnp
    from jax import lax

    n = x.shape[axis]
    rank = x.ndim
    i = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    j = lax.broadcasted_iota(jnp.int32, (n, n), 1)
    if strict:
        mask = (j > i) if reverse else (j < i)
    else:
        mask = (j >= i) if reverse else (j <= i)  # [i, j]: does x[j] count towards out[i]
    shape = (*x.shape[:axis], n, n, *x.shape[axis + 1 :])
    # lax, not jnp.where: the flattened jaxpr must not gain calls (jnp.where is a jitted function)
    mask = lax.broadcast_in_dim(mask, shape, (axis, axis + 1))
    xj = lax.broadcast_in_dim(
        x, shape, tuple(d if d < axis else d + 1 for d in range(rank))
    )  # [.., i, j, ..]
    ident = _identity_of(x, name)
    masked = lax.select(mask, xj, lax.full(shape, ident, x.dtype))
    if name == "cumsum":
        return lax.reduce(masked, ident, lax.add, (axis + 1,))
    return lax.reduce_max(masked, (axis + 1,)) if name == "cummax" else lax.reduce_min(masked, (axis + 1,))


def _cumulative_in_chunks(x: Any, name: str, axis: int, reverse: bool) -> Any:
    """A long cumulative op as two short ones: the axis (padded with the identity to a whole number of
    chunks of c ~ sqrt(n)) is split into [n/c, c]; each chunk is scanned on its own (a masked reduction over
    c), and the chunk totals are scanned exclusively (over n/c) and combined into every element of the
    later (earlier, when reversed) chunks."""
    from jax import lax

    n = x.shape[axis]
    c = CUMULATIVE_CHUNK
    chunks = -(-n // c)
    if chunks > CUMULATIVE_MAX_LEN:
        raise Unsupported(
            f"a cumulative {CUMULATIVE[name]} along an axis of {n} elements "
            f"(at most {CUMULATIVE_MAX_LEN * c} in chunks of {c})"
        )
    ident = _identity_of(x, name)
    # always a pad and a slice (of nothing when c divides n): the same operations at every n
    cfg = [(0, 0, 0)] * x.ndim
    cfg[axis] = (0, chunks * c - n, 0)
    x = lax.pad(x, ident, cfg)
    split = (*x.shape[:axis], chunks, c, *x.shape[axis + 1 :])
    xs = lax.reshape(x, split)
    inner = _masked_prefix(xs, name, axis + 1, reverse, strict=False)  # [.., chunks, c, ..]
    if name == "cumsum":
        totals = lax.reduce(xs, ident, lax.add, (axis + 1,))
    elif name == "cummax":
        totals = lax.reduce_max(xs, (axis + 1,))
    else:
        totals = lax.reduce_min(xs, (axis + 1,))
    # the chunk totals are scanned from a copy (a full-range slice: layout glue): read straight from `xs`,
    # the scanned copy's chunk axis and the chunk axis it is combined into would be one axis to the
    # partitioner, and the mask between them would vanish
    totals = lax.slice(totals, (0,) * totals.ndim, totals.shape)
    before = _masked_prefix(totals, name, axis, reverse, strict=True)  # [.., chunks, ..]
    before = lax.broadcast_in_dim(before, split, tuple(d if d <= axis else d + 1 for d in range(totals.ndim)))
    if name == "cumsum":
        out = inner + before
    elif name == "cummax":
        out = lax.max(inner, before)
    else:
        out = lax.min(inner, before)
    out = lax.reshape(out, x.shape)
    return lax.slice_in_dim(out, 0, n, axis=axis)


SCATTER_MAX_ELEMS = 1 << 24
"""Largest (rows of the operand) x (updates) x (window) product the scatter rewrite builds in a kernel."""


def _scatter_as_masked_reduce(
    operand: Any, indices: Any, updates: Any, params: dict[str, Any], *, add: bool
) -> Any:
    """A scatter of whole rows along one operand dim (`x.at[idx].set(u)` / `.add(u)`, bincount, the scatter
    inside `jnp.repeat`) as a one-hot masked reduction: `out[i] = sum_j (idx[j] == i) * u[j]` (added to the
    operand, or replacing it where some j hits i, the last such j winning). Out-of-range indices match no row,
    which is FILL_OR_DROP's rule; CLIP clamps first. The work is rows x updates x window, so it is kept for
    small scatters (group counts, sequence bounds); a data-dependent write has no Pallas TPU vector form."""
    import jax.numpy as jnp
    from jax import lax

    dn = params["dimension_numbers"]
    if (
        len(dn.scatter_dims_to_operand_dims) != 1
        or tuple(dn.inserted_window_dims) != tuple(dn.scatter_dims_to_operand_dims)
        or tuple(getattr(dn, "operand_batching_dims", ())) != ()
    ):
        raise Unsupported("a scatter other than whole rows along one dim")
    d = int(dn.scatter_dims_to_operand_dims[0])
    n_rows = operand.shape[d]
    window = [operand.shape[k] for k in range(operand.ndim) if k != d]
    idx = indices.reshape(-1)  # index_vector_dim has size 1: one index per update
    n_upd = idx.shape[0]
    upd_window = [updates.shape[k] for k in dn.update_window_dims]
    if upd_window != window:
        raise Unsupported("a scatter of partial rows")
    scatter_dims = [k for k in range(updates.ndim) if k not in dn.update_window_dims]
    # updates -> (n_upd, *window)
    u = jnp.transpose(updates, (*scatter_dims, *dn.update_window_dims)).reshape(n_upd, *window)
    if SIZE_DECISIONS.decide(
        "row_scatter_in_xla", lambda: n_rows * n_upd * max(1, math.prod(window)) > SCATTER_MAX_ELEMS
    ):
        return _row_scatter_in_xla(operand, indices, updates, params, add=add)
    mode = str(params.get("mode"))
    if "CLIP" in mode:
        idx = lax.clamp(jnp.zeros((), idx.dtype), idx, jnp.asarray(n_rows - 1, idx.dtype))
    shape = (n_rows, n_upd, *window)
    rank = len(shape)
    row = lax.broadcasted_iota(idx.dtype, (n_rows, n_upd), 0)
    hit = lax.eq(row, lax.broadcast_in_dim(idx, (n_rows, n_upd), (1,)))  # [i, j]
    hit_b = lax.broadcast_in_dim(hit, shape, (0, 1))
    zero = jnp.zeros(shape, operand.dtype)
    u_b = lax.broadcast_in_dim(u.astype(operand.dtype), shape, tuple(range(1, rank)))
    if add:
        val = lax.reduce(lax.select(hit_b, u_b, zero), np.zeros((), operand.dtype), lax.add, (1,))
        moved = jnp.moveaxis(operand, d, 0) if d else operand
        out = lax.add(moved, val)
    else:
        col = lax.broadcasted_iota(jnp.int32, (n_rows, n_upd), 1)
        none = jnp.full((n_rows, n_upd), -1, jnp.int32)
        last = lax.reduce(lax.select(hit, col, none), np.iinfo(np.int32).min, lax.max, (1,))  # [i]
        pick = lax.eq(col, lax.broadcast_in_dim(last, (n_rows, n_upd), (0,)))
        pick_b = lax.broadcast_in_dim(pick, shape, (0, 1))
        val = lax.reduce(lax.select(pick_b, u_b, zero), np.zeros((), operand.dtype), lax.add, (1,))
        moved = jnp.moveaxis(operand, d, 0) if d else operand
        found = lax.broadcast_in_dim(lax.ge(last, jnp.zeros((), jnp.int32)), moved.shape, (0,))
        out = lax.select(found, val, moved)
    return jnp.moveaxis(out, 0, d) if d else out


def _row_scatter_in_xla(
    operand: Any, indices: Any, updates: Any, params: dict[str, Any], *, add: bool
) -> Any:
    """A scatter of whole rows too large for the one-hot rewrite (one 16K-element row into 4096, a prefill
    chunk's 512 rows of attention output into the token buffer) stays XLA's own in-place scatter: glue
    between kernels that reads the updates and touches only the rows they hit. The harness allows it when
    small next to the kernels (its cost is its updates' elements), as it allows a small reduction."""
    from jax import lax

    fn = lax.scatter_add if add else lax.scatter
    keys = ("dimension_numbers", "indices_are_sorted", "unique_indices", "mode")
    return fn(operand, indices, updates.astype(operand.dtype), **{k: params[k] for k in keys if k in params})


def _strided_grid(idx: np.ndarray, n_scatter: int) -> list[tuple[int, int, int]] | None:
    """For scatter indices `idx` (index vector last) that form a cartesian grid of arithmetic progressions,
    `(axis, offset, stride)` per index component: component j is `offset + stride * arange(n)` along batch
    axis `axis` and constant along the others. None for any other index set."""
    if idx.ndim != n_scatter + 1 or idx.shape[-1] != n_scatter or idx.size == 0:
        return None
    grid: list[tuple[int, int, int]] = []
    for j in range(n_scatter):
        comp = idx[..., j].astype(np.int64)
        axes = [a for a in range(n_scatter) if comp.shape[a] > 1 and not np.all(np.diff(comp, axis=a) == 0)]
        if len(axes) > 1:
            return None
        axis = axes[0] if axes else next((a for a in range(n_scatter) if a not in [g[0] for g in grid]), None)
        if axis is None:
            return None
        line = np.moveaxis(comp, axis, 0).reshape(comp.shape[axis], -1)[:, 0]
        stride = int(line[1] - line[0]) if line.size > 1 else 1
        if stride < 1 or not np.array_equal(line, line[0] + stride * np.arange(line.size)):
            return None
        grid.append((axis, int(line[0]), stride))
    if sorted(g[0] for g in grid) != list(range(n_scatter)):
        return None
    return grid


def _scatter_into_zeros_as_pad(
    eqn: Any, updates: Any, idx: np.ndarray
) -> tuple[Any, list[tuple[int, int, int]]] | None:
    """A scatter (set or add) onto zeros at a strided grid of points, each writing a whole window along the
    other dims, as `lax.pad` with interior padding: `zeros.at[:, ::2, ::2].set(x)` is `x` with one zero
    between neighbours, the input dilation of a transposed convolution. Exact (each point is written once;
    everything else stays zero), and layout work XLA fuses instead of a data-dependent write. Returns the
    updates laid out in the operand's dim order and the padding config; None when the scatter is not of
    that form."""
    from jax import lax

    dn = eqn.params["dimension_numbers"]
    operand = eqn.invars[0].aval
    scattered = [int(d) for d in dn.scatter_dims_to_operand_dims]
    if tuple(getattr(dn, "operand_batching_dims", ())) or sorted(scattered) != sorted(
        dn.inserted_window_dims
    ):
        return None
    grid = _strided_grid(idx, len(scattered))
    if grid is None:
        return None
    window_dims = [int(d) for d in dn.update_window_dims]
    upd_scatter = [k for k in range(updates.ndim) if k not in window_dims]  # in index batch-axis order
    kept = [d for d in range(len(operand.shape)) if d not in scattered]
    if len(kept) != len(window_dims) or len(upd_scatter) != len(scattered):
        return None
    perm, config = [], []
    for d in range(len(operand.shape)):
        size = int(operand.shape[d])
        if d in kept:
            k = window_dims[kept.index(d)]
            if int(updates.shape[k]) != size:
                return None  # a partial window: not a dilation of the whole
            perm.append(k)
            config.append((0, 0, 0))
            continue
        axis, offset, stride = grid[scattered.index(d)]
        k = upd_scatter[axis]
        n = int(updates.shape[k])
        last = offset + stride * (n - 1)
        if offset < 0 or last >= size:
            return None  # some points fall outside: FILL_OR_DROP / CLIP semantics, not a pad
        perm.append(k)
        config.append((offset, size - 1 - last, stride - 1))
    arranged = lax.transpose(updates, tuple(perm)) if perm != list(range(updates.ndim)) else updates
    return arranged.astype(operand.dtype), config


def _dilated_conv(eqn: Any, x: Any, config: list[tuple[int, int, int]], w: Any) -> Any | None:
    """A convolution of `pad(x, config)` whose spatial padding is interior (`x` dilated with zeros, as a
    transposed convolution is written by hand) as the input-dilated convolution of `x` it is, decomposed by
    `_transposed_conv_as_phases`; None when the pad is not of that form."""
    params = eqn.params
    dn = params["dimension_numbers"]
    spatial = list(dn.lhs_spec[2:])
    if any(config[d] != (0, 0, 0) for d in dn.lhs_spec[:2]) or any(min(config[d]) < 0 for d in spatial):
        return None
    if any(int(d) != 1 for d in params.get("lhs_dilation") or ()):
        return None
    dilation = tuple(config[d][2] + 1 for d in spatial)
    if all(d == 1 for d in dilation):
        return None
    padding = tuple(
        (int(lo) + config[d][0], int(hi) + config[d][1])
        for (lo, hi), d in zip(params["padding"], spatial, strict=True)
    )
    return _transposed_conv_as_phases(x, w, dict(params, lhs_dilation=dilation, padding=padding))


CONCRETE_MAX_ELEMS = 1 << 20
"""Largest constant index array `_eval` computes while tracing to match a scatter's index pattern."""


SORT_MAX_LEN = 1 << 17
"""Longest sorted axis for the rank rewrite below (n² comparisons: 2¹⁷ is the routed (token, slot) pairs of
a large MoE layer; beyond that the quadratic work swamps any kernel around it)."""


@dataclass
class _Permutations:
    """Values of one trace known to be permutations of `arange(n)` (an argsort's result, and the index
    arithmetic `x[p]` / `.at[p]` wraps it in), each with its inverse (the rank of every position). A scatter
    whose indices are such a permutation writes every row exactly once, so it is a gather by the inverse:
    `zeros.at[perm].set(u)[q] = u[rank[q]]` -- linear work and plain XLA glue, where a general scatter needs
    the one-hot reduction. Keyed by object identity; the values are kept alive so an id is never reused."""

    ranks: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    marks: dict[int, tuple[Any, str, int]] = field(default_factory=dict)

    def clear(self) -> None:
        self.ranks.clear()
        self.marks.clear()

    def add(self, perm: Any, rank: Any) -> None:
        self.ranks[id(perm)] = (perm, rank)

    def rank_of(self, v: Any) -> Any:
        hit = self.ranks.get(id(v))
        return hit[1] if hit is not None and hit[0] is v else None

    def _mark(self, v: Any) -> tuple[str, int] | None:
        hit = self.marks.get(id(v))
        return (hit[1], hit[2]) if hit is not None and hit[0] is v else None

    def follow(self, eqn: Any, ins: list[Any], outs: list[Any]) -> None:
        """Carry the permutation through the negative-index wrap jnp puts around an index
        (`select_n(p < 0, p, p + n)`, a no-op on a permutation) and the reshapes to an index vector."""
        name = eqn.primitive.name
        if len(outs) != 1 or not ins:
            return
        lit = [getattr(v, "val", None) for v in eqn.invars]
        first = ins[0]
        rank = self.rank_of(first)
        if rank is not None:
            n = int(rank.shape[0])
            if name == "lt" and len(lit) == 2 and lit[1] is not None and int(lit[1]) == 0:
                self.marks[id(outs[0])] = (outs[0], "negative", id(first))
            elif name == "add" and len(lit) == 2 and lit[1] is not None and int(lit[1]) == n:
                self.marks[id(outs[0])] = (outs[0], "wrapped", id(first))
            elif name in ("broadcast_in_dim", "reshape", "convert_element_type", "copy", "copy_p") and (
                math.prod(outs[0].shape) == n and np.issubdtype(outs[0].dtype, np.integer)
            ):
                self.add(outs[0], rank)
        if name == "select_n" and len(ins) == 3:
            pred, keep, wrapped = (self._mark(ins[0]), self.rank_of(ins[1]), self._mark(ins[2]))
            if keep is not None and pred == ("negative", id(ins[1])) and wrapped == ("wrapped", id(ins[1])):
                self.add(outs[0], keep)


PERMUTATIONS = _Permutations()


@dataclass
class _GroupRows:
    """Rows split into consecutive groups by a sizes vector, followed through a reference written one group
    at a time: `ends = cumsum(sizes)`, `row_group = searchsorted(ends, arange(m), side="right")`, and per
    group `where(row_group == g, x, 0).T @ y` (a `lax.map` over the groups). That is a ragged contraction,
    `out[g] = x[rows of g].T @ y[rows of g]` (`lax.ragged_dot_general` with a ragged contracting dim), which
    the grouped family runs reading each row once instead of once per group. Facts, keyed by identity:

    * ("ends", sizes) / ("row_group", sizes, axis): the cumulative sizes; each row's group id along `axis`;
    * ("scalar", s): a broadcast of the 0-d value `s` (the group index inside the map);
    * ("member", sizes, s, axis): `row_group == s`;
    * ("masked", sizes, s, x, x_axis, axis): `where(member, x, 0)`, possibly transposed (rows along `axis`
      of the value, along `x_axis` of `x`).
    """

    facts: dict[int, tuple[Any, tuple[Any, ...]]] = field(default_factory=dict)
    slices: dict[int, tuple[Any, Any, Any]] = field(default_factory=dict)
    """A per-group result -> (itself, the ragged dot over all groups, the group index it was sliced at)."""

    def clear(self) -> None:
        self.facts.clear()
        self.slices.clear()

    def whole(self, res: Any, index: Any) -> Any:
        """The ragged dot over all groups when `res` is its slice at the map's own index `index`."""
        hit = self.slices.get(id(res))
        return hit[1] if hit is not None and hit[0] is res and hit[2] is index else None

    def put(self, v: Any, fact: tuple[Any, ...]) -> None:
        self.facts[id(v)] = (v, fact)

    def get(self, v: Any, kind: str) -> tuple[Any, ...] | None:
        hit = self.facts.get(id(v))
        return hit[1] if hit is not None and hit[0] is v and hit[1][0] == kind else None

    def _any(self, v: Any) -> tuple[Any, ...] | None:
        hit = self.facts.get(id(v))
        return hit[1] if hit is not None and hit[0] is v else None

    def follow(self, eqn: Any, ins: list[Any], outs: list[Any], in_facts: list[str | None]) -> None:
        name = eqn.primitive.name
        if len(outs) != 1 or not ins:
            return
        out = outs[0]
        f0 = self._any(ins[0])
        if name == "broadcast_in_dim":
            if getattr(ins[0], "ndim", None) == 0 and not isinstance(eqn.invars[0], jcore.Literal):
                self.put(out, ("scalar", ins[0]))
            elif f0 is not None and f0[0] in ("row_group", "member", "masked"):
                dims = tuple(int(d) for d in eqn.params["broadcast_dimensions"])
                self.put(out, (*f0[:-1], dims[f0[-1]]))
            return
        if name == "reshape" and f0 is not None and f0[0] in ("row_group", "member", "masked"):
            old, new = tuple(ins[0].shape), tuple(out.shape)
            if new[: len(old)] == old and all(d == 1 for d in new[len(old) :]):  # trailing unit dims
                self.put(out, f0)
            return
        if name == "transpose" and f0 is not None and f0[0] == "masked":
            perm = tuple(int(d) for d in eqn.params["permutation"])
            self.put(out, (*f0[:-1], perm.index(f0[-1])))
            return
        if name == "eq" and len(ins) == 2:
            for a, b in ((ins[0], ins[1]), (ins[1], ins[0])):
                rg, sc = self.get(a, "row_group"), self.get(b, "scalar")
                scalar = sc[1] if sc is not None and a.shape == b.shape else b if b.ndim == 0 else None
                if rg is not None and scalar is not None:
                    self.put(out, ("member", rg[1], scalar, rg[2]))
                    return
            return
        if name == "select_n" and len(ins) == 3 and in_facts[1] == "zeros":
            mem = self.get(ins[0], "member")
            if mem is not None and ins[2].ndim == 2 and ins[0].shape == ins[2].shape:
                self.put(out, ("masked", mem[1], mem[2], ins[2], mem[3], mem[3]))

    def ragged_dot(self, eqn: Any, ins: list[Any]) -> Any:
        """The per-group dot of a masked operand as one ragged contraction, indexed at the group."""
        from jax import lax

        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        m = self.get(ins[0], "masked")
        lhs, rhs = ins
        if m is None or lb or rb or len(lc) != 1 or len(rc) != 1 or rhs.ndim != 2 or lhs.ndim != 2:
            return None
        _, sizes, gid, x, x_axis, axis = m
        if int(lc[0]) != axis or gid.ndim != 0:
            return None
        rows_x = x if x_axis == 0 else lax.transpose(x, (1, 0))  # [m, k]
        rows_y = rhs if int(rc[0]) == 0 else lax.transpose(rhs, (1, 0))  # [m, n]
        dn = lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
        )
        prec = eqn.params.get("precision")
        pref = eqn.params.get("preferred_element_type")
        # The operands are unbatched values from outside the group map; the ragged dot is bound in their own
        # trace (ragged_dot_general's batching rule refuses even unbatched operands inside a vmap).
        with _trace_of(rows_x):
            full = lax.ragged_dot_general(
                rows_x, rows_y, sizes.astype(np.int32), dn, precision=prec, preferred_element_type=pref
            )  # [groups, k, n]
        zero = np.zeros((), np.int32)
        one = lax.dynamic_slice(full, (gid.astype(np.int32), zero, zero), (1, *full.shape[1:]))
        picked = lax.squeeze(one, (0,))  # this group's [k, n]: a gather over the groups once vmapped
        self.slices[id(picked)] = (picked, full, gid)
        return picked


GROUPS = _GroupRows()


def _trace_of(v: Any) -> Any:
    """A context binding primitives in the trace `v` belongs to (the current one for a non-tracer)."""
    import contextlib

    from jax._src import core as core_src

    trace = getattr(v, "_trace", None)
    return core_src.set_current_trace(trace) if trace is not None else contextlib.nullcontext()


def _is_take_along_rows(eqn: Any, ins: list[Any]) -> bool:
    """`jnp.take_along_axis(a, idx[:, None], axis=-1)` on a 2-D computed value: one element per row, picked
    by a per-row index (the label's logit of a cross-entropy). At any row length: a matmul epilogue keeps a
    short row whole and walks a long one in column blocks (online), and a row-wise kernel streams it, so the
    masked sum joins the kernel that computes (or already reads) `a`. Not for a program input or a cast of
    one, which a gather reads in place without any kernel writing it first: the few picked elements cost
    less than the masked sum's compare, select and add on every element."""
    dn = eqn.params["dimension_numbers"]
    operand, idx = ins
    return (
        operand.ndim == 2
        and idx.ndim == 3
        and tuple(idx.shape[1:]) == (1, 1)
        and tuple(dn.operand_batching_dims) == (0,)
        and tuple(dn.start_indices_batching_dims) == (0,)
        and tuple(dn.collapsed_slice_dims) == (1,)
        and tuple(dn.start_index_map) == (1,)
        and tuple(dn.offset_dims) == ()
        and tuple(eqn.params["slice_sizes"]) == (1, 1)
        and np.issubdtype(operand.dtype, np.floating)
    )


def _take_along_rows_as_masked_sum(eqn: Any, ins: list[Any]) -> Any:
    """`a[r, idx[r]]` as `sum_c where(c == idx[r], a[r, c], 0)`: a row reduction, which the kernel that
    computes `a` (a matmul's epilogue, streamed across its column blocks) runs without writing `a` to HBM,
    where a gather outside kernels needs `a` written out first. Exactly one term is non-zero, so the sum is
    the element itself; an index out of range gives the gather's fill value (FILL_OR_DROP) or is clamped."""
    import jax.numpy as jnp
    from jax import lax

    operand, idx = ins
    n_rows, n_cols = (int(d) for d in operand.shape)
    col = idx.reshape(n_rows).astype(np.int32)
    mode = str(eqn.params.get("mode"))
    if "CLIP" in mode or "PROMISE" in mode:
        col = lax.clamp(np.int32(0), col, np.int32(n_cols - 1))
    hit = lax.eq(
        lax.broadcasted_iota(np.int32, (n_rows, n_cols), 1), lax.broadcast_in_dim(col, (n_rows, n_cols), (0,))
    )
    picked = lax.reduce(
        lax.select(hit, operand, jnp.zeros(operand.shape, operand.dtype)),
        np.zeros((), operand.dtype),
        lax.add,
        (1,),
    )
    if "FILL" in mode:
        fill = eqn.params.get("fill_value")
        fill = np.nan if fill is None else fill
        inside = lax.bitwise_and(lax.ge(col, np.int32(0)), lax.lt(col, np.int32(n_cols)))
        picked = lax.select(inside, picked, jnp.full(picked.shape, fill, operand.dtype))
    return lax.broadcast_in_dim(picked, (n_rows, 1), (0,))


def _take_rows(x: Any, idx: Any) -> Any:
    """`x[idx]` along axis 0 for indices known to be in range: one gather (XLA glue), with no call around it
    (`jnp.take` is a jitted function, and the flattened jaxpr must not gain calls)."""
    from jax import lax

    dn = lax.GatherDimensionNumbers(
        offset_dims=tuple(range(1, x.ndim)), collapsed_slice_dims=(0,), start_index_map=(0,)
    )
    return lax.gather(
        x,
        lax.broadcast_in_dim(idx, (idx.shape[0], 1), (0,)),
        dn,
        slice_sizes=(1, *x.shape[1:]),
        mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS,
    )


def _sort_as_rank(
    eqn: Any, ins: list[Any], iota_operands: list[bool], *, key_bound: int | None = None
) -> list[Any]:
    """A 1-D sort (`jnp.sort`, `jnp.argsort`, `lax.sort` with one key) as ranks: the stable position of
    element j is `#{i: k_i < k_j} + #{i < j: k_i == k_j}` (a comparison against every element and a sum --
    a masked reduction the kernel families run), the sorting permutation is the one-hot inverse of the
    ranks (`perm[p] = sum_j j * (rank_j == p)`, another masked reduction), and every operand is gathered by
    it. The ranks are remembered, so a scatter back through the permutation becomes a gather. A stable
    order is a valid answer for an unstable sort; NaN keys, and -0.0 against +0.0, are not ordered as
    `lax.sort` orders them (its total order); validation on the task's inputs would show it. Integer keys
    of a known small range (`key_bound`: top-k indices) are sorted by counting instead, in linear work: the
    n² form at 2¹⁶ routed pairs is a kernel no compiler can hold."""
    from jax import lax

    p = eqn.params
    keys = ins[0]
    if int(p.get("num_keys", 1)) != 1 or keys.ndim != 1 or any(x.shape != keys.shape for x in ins):
        raise Unsupported("a sort other than a 1-D sort by one key")
    n = int(keys.shape[0])
    counting = key_bound is not None and SIZE_DECISIONS.decide(
        "counting_sort", lambda: n > COUNTING_SORT_MIN_LEN and key_bound <= COUNTING_SORT_MAX_RANGE
    )
    if counting:
        perm, rank = _counting_sort_permutation(keys, int(key_bound))
    elif n > SORT_MAX_LEN:
        raise Unsupported(f"a sort of {n} elements (at most {SORT_MAX_LEN} as a rank computation)")
    else:
        perm, rank = _comparison_sort_permutation(keys)
    PERMUTATIONS.add(perm, rank)
    outs = []
    for x, is_iota in zip(ins, iota_operands, strict=True):
        if is_iota:  # argsort's second operand: sorting `arange(n)` gives the permutation itself
            outs.append(lax.convert_element_type(perm, x.dtype) if x.dtype != perm.dtype else perm)
            PERMUTATIONS.add(outs[-1], rank)
        else:
            outs.append(_take_rows(x, perm))
    return outs


COUNTING_SORT_MAX_RANGE = 1024
"""Widest key range [0, R) sorted by counting (`_counting_sort_permutation`: n x R one-hot work)."""

COUNTING_SORT_MIN_LEN = 512
"""Shortest sort done by counting: below it the n² comparison form is as cheap and has fewer kernels."""


def _comparison_sort_permutation(keys: Any) -> tuple[Any, Any]:
    """(perm, rank) of a stable sort by comparing every pair: n² work, for short axes of any key."""
    import jax.numpy as jnp
    from jax import lax

    n = int(keys.shape[0])
    shape = (n, n)  # [j, i]: does element i sort before element j
    kj = lax.broadcast_in_dim(keys, shape, (0,))
    # the same keys along the other axis, through a copy (reversed twice: glue, which XLA folds away): one
    # value broadcast along both axes of a kernel's block would tie those axes together in the partition
    ki = lax.broadcast_in_dim(lax.rev(lax.rev(keys, (0,)), (0,)), shape, (1,))
    j = lax.broadcasted_iota(jnp.int32, shape, 0)
    i = lax.broadcasted_iota(jnp.int32, shape, 1)
    before = lax.bitwise_or(lax.lt(ki, kj), lax.bitwise_and(lax.eq(ki, kj), lax.lt(i, j)))
    one = lax.convert_element_type(before, jnp.int32)
    rank = lax.reduce(one, np.zeros((), np.int32), lax.add, (1,))  # i32[n]
    # through glue (reversed twice) so the ranks are written by their own kernel: the inversion below
    # reduces along the other axis, and one kernel holding both reduced axes whole would need [n, n] in VMEM
    rank = lax.rev(lax.rev(rank, (0,)), (0,))
    # perm[p] = the j whose rank is p
    hit = lax.eq(lax.broadcast_in_dim(rank, shape, (1,)), lax.broadcasted_iota(jnp.int32, shape, 0))  # [p, j]
    jj = lax.broadcasted_iota(jnp.int32, shape, 1)
    perm = lax.reduce(lax.select(hit, jj, jnp.zeros(shape, jnp.int32)), np.zeros((), np.int32), lax.add, (1,))
    return perm, rank


def _counting_sort_permutation(keys: Any, bound: int) -> tuple[Any, Any]:
    """(perm, rank) of a stable sort of integer keys known to lie in [0, bound) (top-k expert ids: MoE
    dispatch), in about n x (bound + c + n/c) work instead of n². The keys, padded with `bound` (no key),
    are split into chunks of c; with `hot[ch, i, e] = (key == e)`:

    * `occ[ch, i]` = how many earlier elements of the chunk hold the same key (c x c compares per chunk),
      `before[ch, e]` = the occurrences of key e in earlier chunks (a masked prefix over the chunk totals),
      `start[e]` = the keys' exclusive cumulative count; `rank = start[k] + before[ch, k] + occ`, the first
      two picked by the one-hot (a masked reduction over the keys);
    * the inverse: position p holds key `e(p) = #{e: end[e] <= p}` as its `m`-th occurrence; its chunk is
      the last one with `before[ch, e(p)] <= m` (one row of `before`ᵀ gathered per p: a contiguous row copy,
      XLA glue) and within it the element whose (key, occurrence) code is `e(p) * c + (m - before)` (one
      row of the chunk's codes gathered per p, matched by a masked sum).

    Keys outside [0, bound) would give a wrong order; the bound comes from how the keys were made."""
    import jax.numpy as jnp
    from jax import lax

    n = int(keys.shape[0])
    c = CUMULATIVE_CHUNK
    chunks = -(-n // c)
    keys = lax.pad(lax.convert_element_type(keys, jnp.int32), np.int32(bound), [(0, chunks * c - n, 0)])
    k2 = lax.reshape(keys, (chunks, c))
    shape = (chunks, c, bound)
    hot_b = lax.eq(lax.broadcast_in_dim(k2, shape, (0, 1)), lax.broadcasted_iota(jnp.int32, shape, 2))
    hot = lax.convert_element_type(hot_b, jnp.int32)  # i32[chunks, c, bound]
    totals = _glue_copy(lax.reduce(hot, np.int32(0), lax.add, (1,)))  # i32[chunks, bound]: per chunk
    # occurrence of each key within its chunk: the earlier equal keys of the chunk (c x c compares per
    # chunk; a prefix of the one-hot over c would be bound times that)
    pair = (chunks, c, c)  # [ch, i, j]
    k_j = lax.broadcast_in_dim(_glue_copy(k2), pair, (0, 2))
    k_i = lax.broadcast_in_dim(k2, pair, (0, 1))
    earlier = lax.le(lax.broadcasted_iota(jnp.int32, pair, 2), lax.broadcasted_iota(jnp.int32, pair, 1))
    same = lax.convert_element_type(lax.bitwise_and(lax.eq(k_j, k_i), earlier), jnp.int32)
    occ = lax.sub(lax.reduce(same, np.int32(0), lax.add, (2,)), jnp.ones((chunks, c), jnp.int32))
    before = _glue_copy(_masked_prefix(totals, "cumsum", 0, False, strict=True))  # i32[chunks, bound]
    last = (chunks - 1, 0)
    count = lax.add(
        lax.reshape(lax.slice(before, last, (chunks, bound)), (bound,)),
        lax.reshape(lax.slice(totals, last, (chunks, bound)), (bound,)),
    )  # i32[bound]
    start = _glue_copy(_masked_prefix(count, "cumsum", 0, False, strict=True))  # i32[bound], exclusive
    end = _glue_copy(lax.add(start, count))
    offset = lax.add(lax.broadcast_in_dim(before, shape, (0, 2)), lax.broadcast_in_dim(start, shape, (2,)))
    base = lax.reduce(lax.mul(hot, offset), np.int32(0), lax.add, (2,))  # i32[chunks, c]
    rank = _glue_copy(lax.slice(lax.reshape(lax.add(base, occ), (chunks * c,)), (0,), (n,)))  # i32[n]
    code = _glue_copy(
        lax.select(
            lax.lt(k2, jnp.full((chunks, c), bound, jnp.int32)),
            lax.add(lax.mul(k2, jnp.full((chunks, c), c, jnp.int32)), occ),
            jnp.full((chunks, c), -1, jnp.int32),
        )
    )  # i32[chunks, c]: (key, occurrence in its chunk), -1 for padding
    # inverse: key and occurrence of every sorted position p
    p = lax.broadcasted_iota(jnp.int32, (n, bound), 0)
    ends_b = lax.broadcast_in_dim(end, (n, bound), (1,))
    done = lax.le(ends_b, p)  # [p, e]: key e's run ends at or before p
    key_at = _glue_copy(lax.reduce(lax.convert_element_type(done, jnp.int32), np.int32(0), lax.add, (1,)))
    start_at = lax.reduce_max(lax.select(done, ends_b, jnp.zeros((n, bound), jnp.int32)), (1,))
    want = _glue_copy(lax.sub(lax.broadcasted_iota(jnp.int32, (n,), 0), start_at))  # i32[n]: m
    rows = _take_rows(lax.transpose(before, (1, 0)), key_at)  # i32[n, chunks]: before[:, e(p)]
    passed = lax.le(rows, lax.broadcast_in_dim(want, (n, chunks), (0,)))
    chunk_at = _glue_copy(
        lax.sub(
            lax.reduce(lax.convert_element_type(passed, jnp.int32), np.int32(0), lax.add, (1,)),
            jnp.ones((n,), jnp.int32),
        )
    )
    seen_before = lax.reduce_max(lax.select(passed, rows, jnp.zeros((n, chunks), jnp.int32)), (1,))
    target = _glue_copy(
        lax.add(lax.mul(key_at, jnp.full((n,), c, jnp.int32)), lax.sub(want, seen_before))
    )  # i32[n]
    codes = _take_rows(code, chunk_at)  # i32[n, c]: the codes of p's chunk
    hit = lax.eq(codes, lax.broadcast_in_dim(target, (n, c), (0,)))
    within = lax.reduce(
        lax.select(hit, lax.broadcasted_iota(jnp.int32, (n, c), 1), jnp.zeros((n, c), jnp.int32)),
        np.int32(0),
        lax.add,
        (1,),
    )
    perm = lax.add(lax.mul(chunk_at, jnp.full((n,), c, jnp.int32)), within)
    return perm, rank


def _glue_copy(x: Any) -> Any:
    """A copy (reversed twice along axis 0, which XLA folds away) that the partitioner sees as a new value:
    read in place, a per-key or per-chunk vector would be one axis with the axis it is combined with, and
    the masks between the two would vanish in the partition."""
    from jax import lax

    return lax.rev(lax.rev(x, (0,)), (0,))


def _scatter_by_permutation(
    operand: Any, indices: Any, updates: Any, rank: Any, params: dict[str, Any], *, add: bool
) -> Any:
    """A scatter of whole rows whose indices are a permutation of the operand's rows (`y.at[order].set(u)`
    after an argsort): every row is written once, by update `rank[row]`, so the result is the updates
    gathered by the inverse permutation (plus the operand for a scatter-add)."""
    from jax import lax

    dn = params["dimension_numbers"]
    if (
        tuple(dn.scatter_dims_to_operand_dims) != (0,)
        or tuple(dn.inserted_window_dims) != (0,)
        or tuple(getattr(dn, "operand_batching_dims", ())) != ()
        or operand.shape[0] != rank.shape[0]
        or tuple(dn.update_window_dims) != tuple(range(1, updates.ndim))
        or updates.shape != operand.shape
    ):
        return _scatter_as_masked_reduce(operand, indices, updates, params, add=add)
    moved = _take_rows(updates.astype(operand.dtype), rank)
    return lax.add(operand, moved) if add else moved


def _searchsorted_side(eqn: Any) -> str | None:
    """'left' or 'right' for `jnp.searchsorted`'s binary-search implementation (a scan whose body compares
    the query with `le`/`lt`), None for another implementation (which is inlined as it is)."""
    names = [e.primitive.name for e in walk_eqns(eqn.params["jaxpr"])]
    if "scan" not in names and "while" not in names:
        return None
    cmp = [n for n in names if n in ("lt", "lt_to", "le", "le_to")]
    if not cmp:
        return None
    return "right" if cmp[0].startswith("lt") else "left"


WEIGHTED_SUM_MAX_K = 64
"""Longest contraction (at the task's own shapes) of a batched matrix-vector product rewritten as a multiply
and a sum (see below): a mixture's 8 to 64 experts, not a decode step's keys (hundreds and more at a real
decode's shapes; the attention families read those as attention)."""


def _weighted_sum_side(eqn: Any, ins: list[Any], in_facts: list[str | None]) -> int | None:
    """Which operand (0: lhs, 1: rhs) of a dot_general is the weights of a weighted sum over a short axis,
    or None. That operand has no free dims (only batch and contracting ones: per batch element, a vector),
    the contraction is at most WEIGHTED_SUM_MAX_K long, and both are floating point: a mixture's combine
    (`einsum('bsne,bsn->bse', expert_outputs, weights)` over 8 experts). As a matmul it is a product with
    one output column per batch element and a contraction the width of a few sublanes: the MXU does no
    reuse, and the batched-matmul layout puts the short contracted axis on the lanes (a [.., E, 8]
    transpose of the other operand, padded to 128 lanes: 16x its bytes in HBM). Only where the other
    operand's contraction is not along its last dim: contracted along its lanes (a decode step's q . k),
    the matmul reads it in place and the attention families keep recognising it. Only where the data is
    computed by the program (an input is read in place by the attention families' p . v)."""
    lhs, rhs = ins
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    if not all(jax.numpy.issubdtype(x.dtype, jax.numpy.floating) for x in (lhs, rhs, eqn.outvars[0].aval)):
        return None
    for side, (x, c, b) in enumerate([(lhs, lc, lb), (rhs, rc, rb)]):
        other, other_c = ins[1 - side], (rc, lc)[side]
        other_free = other.ndim - len(c) - len(b)
        data_computed = in_facts[1 - side] != "input"
        if len(c) + len(b) == x.ndim and other_free > 0 and other.ndim - 1 not in other_c and data_computed:
            k = math.prod(lhs.shape[a] for a in lc)  # the task's own shapes decide; the others replay it
            return (
                side if SIZE_DECISIONS.decide("weighted_sum", lambda k=k: k <= WEIGHTED_SUM_MAX_K) else None
            )
    return None


def _dot_as_weighted_sum(eqn: Any, ins: list[Any], side: int) -> Any:
    """The dot_general as `sum_k data * weights` in the data operand's own layout: the weights are broadcast
    against the data (batch dims to batch dims, contracted to contracted, 1 on the data's free dims), the
    product is summed over the contracted dims in float32, and only the (small) result is transposed to
    dot_general's order (batch dims, then the data's free dims)."""
    import jax.numpy as jnp

    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    w, data = ins[side], ins[1 - side]
    wc, dc = (lc, rc) if side == 0 else (rc, lc)
    wb, db = (lb, rb) if side == 0 else (rb, lb)
    source = {d: a for d, a in zip([*db, *dc], [*wb, *wc], strict=True)}  # data axis -> weights axis
    order = [source[d] for d in range(data.ndim) if d in source]
    wt = jnp.transpose(w, order) if order != sorted(order) else w
    wt = wt.reshape(tuple(data.shape[d] if d in source else 1 for d in range(data.ndim)))
    acc = jnp.float32 if jnp.finfo(eqn.outvars[0].aval.dtype).bits <= 32 else eqn.outvars[0].aval.dtype
    summed = jnp.sum(data.astype(acc) * wt.astype(acc), axis=tuple(dc))
    kept = [d for d in range(data.ndim) if d not in dc]  # the result's dims, in the data's order
    want = [*db, *(d for d in range(data.ndim) if d not in db and d not in dc)]
    if kept != want:
        summed = jnp.transpose(summed, [kept.index(d) for d in want])
    return summed.astype(eqn.outvars[0].aval.dtype)


def _searchsorted_as_count(sorted_arr: Any, query: Any, side: str, dtype: Any) -> Any:
    """The insertion index of `query` in a sorted 1-D array is how many entries precede it: a comparison
    against every entry and a sum, the same answer as the binary search for sorted input (NaN ordering
    aside). The search's loop cannot run in a kernel; the count is a map and a reduction."""
    import jax.numpy as jnp

    a = sorted_arr.reshape((1,) * query.ndim + (sorted_arr.shape[0],))
    q = jnp.expand_dims(query, query.ndim)
    before = (a <= q) if side == "right" else (a < q)
    return jnp.sum(before.astype(jnp.int32), axis=-1).astype(dtype)


def _scan_as_vmap(eqn: Any, ins: list[Any], in_facts: list[str | None]) -> list[Any]:
    """`lax.map(f, xs)` is a scan without a carry: every iteration is independent, so it is `vmap(f)(xs)`."""
    body, body_consts = _as_closed(eqn.params["jaxpr"])
    n_consts = eqn.params["num_consts"]
    consts, xs = ins[:n_consts], ins[n_consts:]

    wholes: dict[int, Any] = {}

    def one(*x: Any) -> list[Any]:
        res = _eval(body, body_consts, [*consts, *x])
        for k, r in enumerate(res):
            if len(x) == 1 and (w := GROUPS.whole(r, x[0])) is not None:
                wholes[k] = w
        return res

    outs = list(jax.vmap(one)(*xs))
    # mapped over arange(groups), the per-group slices of one ragged dot stack up to that dot itself
    for k, w in wholes.items():
        if in_facts[n_consts:] == ["arange"] and int(xs[0].shape[0]) == int(w.shape[0]):
            outs[k] = w
    return outs


DIRECT_CONV_MAX_BLOCK_BYTES = 16 * 2**20
"""The smallest halo'd input block of the conv family (one output row's window: `k` planes of the padded
input) must fit this, double-buffered, next to the weights and outputs."""


def is_depthwise(params: dict[str, Any], x_shape: tuple[int, ...], w_shape: tuple[int, ...]) -> bool:
    """One filter per channel (groups = C_in = C_out, multiplier 1): the conv kernel's VPU variant."""
    dn = params["dimension_numbers"]
    groups = params.get("feature_group_count", 1)
    c_in, c_out = x_shape[dn.lhs_spec[1]], w_shape[dn.rhs_spec[0]]
    return groups > 1 and groups == c_in == c_out and w_shape[dn.rhs_spec[1]] == 1


def direct_conv_ok(
    params: dict[str, Any], x_shape: tuple[int, ...], itemsize: int, w_shape: tuple[int, ...]
) -> bool:
    """Can this convolution run as shifted matmuls over halo'd blocks of rows in VMEM? A 1x1 convolution is
    left to the patches path: its "patches" are the input itself, and the matmul family fuses its epilogue."""
    nsp = len(x_shape) - 2
    if nsp not in (2, 3):
        return False
    if all(w_shape[d] == 1 for d in params["dimension_numbers"].rhs_spec[2:]):
        return False
    if any(s != 1 for s in params["window_strides"]):
        return False
    if any(d != 1 for d in (params.get("lhs_dilation") or ())) or any(
        d != 1 for d in (params.get("rhs_dilation") or ())
    ):
        return False
    dn = params["dimension_numbers"]
    if params.get("batch_group_count", 1) != 1:
        return False
    if params.get("feature_group_count", 1) != 1 and not is_depthwise(params, x_shape, w_shape):
        return False
    plane = math.prod(x_shape[d] for d in (dn.lhs_spec[1], *dn.lhs_spec[3:])) * itemsize
    plane = plane * math.prod(
        1 + (int(a) + int(b)) / max(1, x_shape[d])
        for (a, b), d in zip(params["padding"][1:], dn.lhs_spec[3:], strict=True)
    )
    return w_shape[dn.rhs_spec[2]] * plane <= DIRECT_CONV_MAX_BLOCK_BYTES


@dataclass
class _SizeDecisions:
    """Rewrites whose form depends on sizes (keep a convolution whole for the conv family? scan a long axis
    in chunks?) are decided once, by the first trace (the task's own shapes), and the other configurations
    (validation shapes) replay those decisions in order, so every trace has the same structure: a choice
    made per trace would give a task whose sizes fall on both sides of a threshold two different programs,
    which the author refuses."""

    decisions: list[tuple[str, Any]] = field(default_factory=list)
    replay: bool = False
    position: int = 0
    direct_conv: bool = False
    """Set by `trace_reference(direct_conv=True)`: convolutions `direct_conv_ok` accepts stay one primitive
    (the conv family's kernel) instead of becoming patches + a matmul."""

    def reset(self, *, direct_conv: bool) -> None:
        self.decisions, self.replay, self.position, self.direct_conv = [], False, 0, direct_conv

    def start_trace(self, *, replay: bool) -> None:
        self.replay, self.position = replay, 0

    def decide(self, kind: str, choose: Callable[[], Any]) -> Any:
        if self.replay:
            if self.position < len(self.decisions) and self.decisions[self.position][0] == kind:
                self.position += 1
                return self.decisions[self.position - 1][1]
            return choose()  # one the first trace did not make: the structures differ anyway (refused)
        value = choose()
        self.decisions.append((kind, value))
        return value


SIZE_DECISIONS = _SizeDecisions()


def _direct_conv_decision(params: dict[str, Any], x: Any, w: Any) -> bool:
    if not SIZE_DECISIONS.direct_conv:
        return False
    return SIZE_DECISIONS.decide(
        "direct_conv",
        lambda: direct_conv_ok(params, tuple(x.shape), np.dtype(x.dtype).itemsize, tuple(w.shape)),
    )


def _conv(x: Any, w: Any, params: dict[str, Any]) -> Any:
    """A convolution without input dilation: kept whole for the conv family, or as patches."""
    from jax import lax

    if _direct_conv_decision(params, x, w):
        return lax.conv_general_dilated_p.bind(x, w, **params)
    REWRITTEN.add("conv_general_dilated")
    return _conv_as_patches(x, w, params)


def _transposed_conv_as_phases(x: Any, w: Any, params: dict[str, Any]) -> Any:
    """An input-dilated (transposed) convolution as one stride-1 convolution of the undilated input per output
    phase, interleaved. With dilation s along a dim, output `s*q + r` only meets the kernel taps `k0 + s*t`
    whose dilated input position is a real element (`k0 = (lo - r) mod s`), and those read input `q + t + e`
    (`e = (r + k0 - lo) / s`): a plain convolution with the kernel's every s-th tap. With kernel dilation d
    the taps `k` with `d*k = lo - r (mod s)` are every `s/g`-th (`g = gcd(d, s)`; none when g does not
    divide `lo - r`), read with dilation `d/g`. The zeros the dilation
    inserts are never multiplied (a stride-2 3-D transposed convolution did 8x its useful MXU work), and
    each phase is a convolution the conv family takes. The phases' results are stacked and interleaved
    (layout), then cropped to the output size. Exact: every product of the original is computed once, in
    the same float32 accumulation."""
    import jax.numpy as jnp
    from jax import lax

    dn = params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    nsp = len(lhs_spec) - 2
    dil = [int(d) for d in params["lhs_dilation"]]
    rdil = [int(d) for d in (params.get("rhs_dilation") or (1,) * nsp)]
    if any(int(st) != 1 for st in params["window_strides"]):
        raise Unsupported(
            "a transposed convolution with window strides (an input-dilated, strided convolution)"
        )
    if params.get("batch_group_count", 1) != 1:
        raise Unsupported("a convolution with batch_group_count > 1")
    n = [int(x.shape[lhs_spec[2 + i]]) for i in range(nsp)]
    k = [int(w.shape[rhs_spec[2 + i]]) for i in range(nsp)]
    lo = [int(p[0]) for p in params["padding"]]
    hi = [int(p[1]) for p in params["padding"]]
    out_len = [(n[i] - 1) * dil[i] + 1 + lo[i] + hi[i] - (k[i] - 1) * rdil[i] for i in range(nsp)]
    if any(o <= 0 for o in out_len):
        raise Unsupported("a transposed convolution with an empty output")
    q = [-(-out_len[i] // dil[i]) for i in range(nsp)]
    gcd = [math.gcd(rdil[i], dil[i]) for i in range(nsp)]
    step = [dil[i] // gcd[i] for i in range(nsp)]  # kernel taps apart within one phase
    plain = dict(
        params,
        lhs_dilation=(1,) * nsp,
        padding=tuple((0, 0) for _ in range(nsp)),
        rhs_dilation=tuple(rdil[i] // gcd[i] for i in range(nsp)),
    )
    phases = []
    for r in itertools.product(*[range(d) for d in dil]):
        pad_x = [(0, 0, 0)] * x.ndim
        w_start, w_limit, w_step = [0] * w.ndim, list(w.shape), [1] * w.ndim
        taps_everywhere = True
        for i in range(nsp):
            want = (lo[i] - r[i]) % dil[i]  # d * k0 = want (mod s)
            if want % gcd[i]:
                k0, taps = 0, 0
            else:
                unit = rdil[i] // gcd[i]
                k0 = (want // gcd[i]) * pow(unit, -1, step[i]) % step[i] if step[i] > 1 else 0
                taps = -(-(k[i] - k0) // step[i]) if k0 < k[i] else 0
            taps_everywhere &= taps > 0
            e = (r[i] + rdil[i] * k0 - lo[i]) // dil[i]
            reach = (rdil[i] // gcd[i]) * (max(taps, 1) - 1)  # input positions one phase output spans
            pad_x[lhs_spec[2 + i]] = (-e, (q[i] - 1 + reach + e) - (n[i] - 1), 0)
            w_start[rhs_spec[2 + i]], w_step[rhs_spec[2 + i]] = k0, step[i]
            w_limit[rhs_spec[2 + i]] = min(k[i], k0 + step[i] * (taps - 1) + 1) if taps else k0
        if not taps_everywhere:  # no tap of the kernel lands on this phase: its outputs are zero
            shape = [0] * x.ndim
            shape[out_spec[0]], shape[out_spec[1]] = int(x.shape[lhs_spec[0]]), int(w.shape[rhs_spec[0]])
            for i in range(nsp):
                shape[out_spec[2 + i]] = q[i]
            phases.append(lax.full(shape, 0, params.get("preferred_element_type") or x.dtype))
            continue
        wp = lax.slice(w, w_start, w_limit, w_step)
        spatial = [pad_x[lhs_spec[2 + i]][:2] for i in range(nsp)]
        if all(p >= 0 for lo_hi in spatial for p in lo_hi):  # the convolution pads (in its kernel's halo)
            phases.append(_conv(x, wp, dict(plain, padding=tuple(spatial))))
        else:
            phases.append(_conv(lax.pad(x, jnp.zeros((), x.dtype), pad_x), wp, plain))
    # (phases..., out dims) -> out dims with each spatial dim (Q, s) merged, Q major
    y = lax.concatenate([lax.expand_dims(p, (0,)) for p in phases], 0).reshape(*dil, *phases[0].shape)
    perm: list[int] = []
    for d in range(phases[0].ndim):
        perm.append(nsp + d)
        if d in out_spec[2:]:
            perm.append(list(out_spec[2:]).index(d))
    y = lax.transpose(y, perm)
    full = list(phases[0].shape)
    for i in range(nsp):
        full[out_spec[2 + i]] = q[i] * dil[i]
    y = y.reshape(full)
    crop = list(full)
    for i in range(nsp):
        crop[out_spec[2 + i]] = out_len[i]
    return lax.slice(y, [0] * y.ndim, crop) if crop != full else y


def _one_pass_moments_decision(conv: Any, count: int, grouped: bool) -> bool:
    """Norm statistics in the conv kernel's epilogue (moments.py) when the conv stays whole for the conv
    family and that saves a pass: always for a group norm (its split layout is a relayout copy), for a
    plain one when its rows are longer than a row-wise kernel holds whole (which reads them once anyway:
    an instance norm of a 128 x 128 image). Decided at the task's shapes like the conv itself, and replayed."""
    from maxkernel.authors.offline.partition import STREAM_ELEMS

    if conv.primitive.name == "dot_general":
        # a batch norm over a linear layer's rows: the matmul kernel walks M sequentially and accumulates
        # both column sums in its epilogue; a row-wise kernel would hold whole columns of M rows
        from maxkernel.authors.offline.partition import COLUMN_WHOLE_ELEMS

        return SIZE_DECISIONS.decide(
            "one_pass_moments_dot", lambda: not grouped and count > COLUMN_WHOLE_ELEMS
        )
    if not SIZE_DECISIONS.direct_conv:
        return False
    x, w = conv.invars
    return SIZE_DECISIONS.decide(
        "one_pass_moments",
        lambda: (
            (grouped or count > STREAM_ELEMS)
            and direct_conv_ok(
                conv.params,
                tuple(int(d) for d in x.aval.shape),
                np.dtype(x.aval.dtype).itemsize,
                tuple(int(d) for d in w.aval.shape),
            )
        ),
    )


WINDOW_REDUCTIONS = {"reduce_window_sum": "sum", "reduce_window_max": "max", "reduce_window_min": "min"}


def _pool_splits(eqn: Any) -> bool:
    """A pooling whose windows tile the input (window == stride per dim, no padding or dilation)."""
    p = eqn.params
    return (
        all(int(a) == 0 and int(b) == 0 for a, b in p["padding"])
        and all(int(d) == 1 for d in (*p["base_dilation"], *p["window_dilation"]))
        and all(int(k) == int(s) for k, s in zip(p["window_dimensions"], p["window_strides"], strict=True))
    )


def _pool_as_split(x: Any, eqn: Any) -> Any:
    """`reduce_window` with windows that tile the input, as the reshape that splits each pooled dim into
    (out, window) and a reduction over the window dims (what a pool written by hand is, and the form a
    conv kernel fuses); a remainder that no window covers (VALID) is sliced off first."""
    import jax.numpy as jnp
    from jax import lax

    windows = [int(k) for k in eqn.params["window_dimensions"]]
    outs = [int(n) // k for n, k in zip(x.shape, windows, strict=True)]
    covered = [o * k for o, k in zip(outs, windows, strict=True)]
    if list(x.shape) != covered:
        x = lax.slice(x, [0] * x.ndim, covered)
    split: list[int] = []
    axes: list[int] = []
    for o, k in zip(outs, windows, strict=True):
        split.append(o)
        if k > 1:
            split.append(k)
            axes.append(len(split) - 1)
    y = jnp.reshape(x, split)
    how = WINDOW_REDUCTIONS[eqn.primitive.name]
    reduce = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}[how]
    return reduce(y, axis=tuple(axes)).astype(eqn.outvars[0].aval.dtype)


def _conv_as_patches(x: Any, w: Any, params: dict[str, Any]) -> Any:
    """A convolution as im2col + `dot_general`: one strided slice of the padded input per kernel tap,
    concatenated along channels (layout only), times the weights reshaped to (taps * C_in, C_out).
    Depthwise convolutions (one input channel per group) become a weighted sum over taps instead, and
    other grouped convolutions a batched matmul over the groups."""
    import jax.numpy as jnp
    from jax import lax

    dn = params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    if any(d != 1 for d in params.get("lhs_dilation") or ()):
        raise Unsupported("a transposed (input-dilated) convolution")
    if params.get("batch_group_count", 1) != 1:
        raise Unsupported("a convolution with batch_group_count > 1")
    groups = params.get("feature_group_count", 1)
    nsp = len(lhs_spec) - 2
    strides = params["window_strides"]
    rdil = params.get("rhs_dilation") or (1,) * nsp
    padding = params["padding"]
    pref = params.get("preferred_element_type")
    prec = params.get("precision")
    # x -> (N, S..., C); w -> (K..., C_in/groups, C_out)
    xt = jnp.transpose(x, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1]))
    wt = jnp.transpose(w, (*rhs_spec[2:], rhs_spec[1], rhs_spec[0]))
    ksz = wt.shape[:nsp]
    cfg = [(0, 0, 0)] + [(int(lo), int(hi), 0) for lo, hi in padding] + [(0, 0, 0)]
    if any(c != (0, 0, 0) for c in cfg):
        xt = lax.pad(xt, jnp.zeros((), xt.dtype), cfg)
    sp = xt.shape[1 : 1 + nsp]
    out_sp = [(sp[i] - (ksz[i] - 1) * rdil[i] - 1) // strides[i] + 1 for i in range(nsp)]
    if groups == 1 and all(strides[i] == ksz[i] and rdil[i] == 1 for i in range(nsp)):
        # Non-overlapping windows (patch embeddings: a k x k kernel at stride k): each input element belongs
        # to exactly one patch, so the patch matrix is the input itself re-laid out — one transpose, where
        # one strided slice per tap (256 of them for 16 x 16) copied the input once per tap.
        y = _patchify(xt, ksz, out_sp).reshape(xt.shape[0], *out_sp, -1)  # (N, O..., K... * C)
        wm = wt.reshape(-1, wt.shape[-1])
        y = lax.dot_general(
            y, wm, (((nsp + 1,), (0,)), ((), ())), precision=prec, preferred_element_type=pref
        )
        return jnp.transpose(y, _out_perm(out_spec, nsp))
    taps = []
    for off in itertools.product(*[range(k) for k in ksz]):
        start = [0] + [o * d for o, d in zip(off, rdil, strict=True)] + [0]
        limit = (
            [xt.shape[0]]
            + [start[1 + i] + (out_sp[i] - 1) * strides[i] + 1 for i in range(nsp)]
            + [xt.shape[-1]]
        )
        taps.append(lax.slice(xt, start, limit, (1, *strides, 1)))
    c_in = xt.shape[-1]
    c_out = wt.shape[-1]
    n_taps = len(taps)
    if groups == 1:
        patches = taps[0] if n_taps == 1 else lax.concatenate(taps, nsp + 1)  # (N, O..., taps*C)
        wm = wt.reshape(n_taps * c_in, c_out)
        y = lax.dot_general(
            patches, wm, (((nsp + 1,), (0,)), ((), ())), precision=prec, preferred_element_type=pref
        )
    elif groups == c_in and wt.shape[-2] == 1:
        mult = c_out // c_in
        stacked = lax.concatenate(
            [lax.expand_dims(t, (nsp + 1,)) for t in taps], nsp + 1
        )  # (N, O..., taps, C)
        wk = wt.reshape(n_taps, c_out)  # (taps, C*mult), output channel = c * mult + m
        if mult != 1:
            stacked = jnp.repeat(stacked, mult, axis=-1)
        acc_t = pref if pref is not None else jnp.result_type(x.dtype, w.dtype)
        y = jnp.sum(stacked.astype(acc_t) * wk.astype(acc_t), axis=nsp + 1)
    else:
        cg = c_in // groups
        og = c_out // groups
        patches = (
            lax.concatenate([t.reshape(*t.shape[:-1], groups, cg) for t in taps], nsp + 2)
            if n_taps > 1
            else taps[0].reshape(*taps[0].shape[:-1], groups, cg)
        )  # (N, O..., G, taps*cg)
        wg = wt.reshape(n_taps, cg, groups, og).transpose(2, 0, 1, 3).reshape(groups, n_taps * cg, og)
        y = lax.dot_general(
            patches, wg, (((nsp + 2,), (1,)), ((nsp + 1,), (0,))), precision=prec, preferred_element_type=pref
        )  # (G, N, O..., og)
        y = jnp.moveaxis(y, 0, -2).reshape(*y.shape[1:-1], c_out)
    return jnp.transpose(y, _out_perm(out_spec, nsp))


def _out_perm(out_spec: Sequence[int], nsp: int) -> list[int]:
    """The transpose from (N, O..., C_out) to the convolution's output layout."""
    perm = [0] * (nsp + 2)
    perm[out_spec[0]] = 0
    perm[out_spec[1]] = nsp + 1
    for i in range(nsp):
        perm[out_spec[2 + i]] = 1 + i
    return perm


def _patchify(xt: Any, ksz: Sequence[int], out_sp: Sequence[int]) -> Any:
    """(N, S..., C) cut into non-overlapping K... windows: (N, O..., K..., C), the window's offsets in the
    same order as the weights' (K..., C_in) rows. The tail of each spatial dim no window covers is dropped."""
    from jax import lax

    nsp = len(ksz)
    covered = [o * k for o, k in zip(out_sp, ksz, strict=True)]
    if list(xt.shape[1 : 1 + nsp]) != covered:
        xt = lax.slice(xt, [0] * xt.ndim, [xt.shape[0], *covered, xt.shape[-1]])
    split = [xt.shape[0]] + [d for o, k in zip(out_sp, ksz, strict=True) for d in (o, k)] + [xt.shape[-1]]
    perm = [0] + [1 + 2 * i for i in range(nsp)] + [2 + 2 * i for i in range(nsp)] + [1 + 2 * nsp]
    return lax.transpose(xt.reshape(split), perm)


def flatten(fn: Callable[..., Any], specs: Sequence[jax.ShapeDtypeStruct]) -> Any:
    """A `ClosedJaxpr` of `fn` with calls inlined, `lax.map` vectorised and dead equations dropped."""
    closed = _inline_calls(jax.make_jaxpr(fn)(*specs), specs)

    def run(*args: Any) -> list[Any]:
        return _eval(closed.jaxpr, closed.consts, args, ["input"] * len(args))

    flat = jax.make_jaxpr(run)(*specs)
    return _dce(flat)


def _inline_calls(closed: Any, specs: Sequence[jax.ShapeDtypeStruct]) -> Any:
    """The same program with its calls (`jit`, custom derivatives, `remat`) inlined and repeated equations
    computed once, nothing else changed, so the rewrites that match patterns across several equations
    (`OnePassMoments`, `_CastMotion`) and the partition see a pattern whole where the library splits it:
    `jnp.var(y)` is its own `jit`, whose body sees `y` as an argument and not the convolution that produced
    it, and recomputes the `jnp.mean(y)` the caller already has; two copies of one mean then seed two
    kernels. Calls `_apply` rewrites by name (`searchsorted`) stay calls; equations on literals alone
    (iotas, constants: `_eval` re-emits them per use) and equations with effects or inner programs are
    never merged."""
    seen: dict[tuple[Any, ...], list[Any]] = {}
    keep: list[Any] = []  # the values keyed by id() stay alive, so no id is reused during the trace

    def key_of(eqn: Any, ins: list[Any]) -> tuple[Any, ...] | None:
        if eqn.effects or all(isinstance(v, jcore.Literal) for v in eqn.invars):
            return None
        params = []
        for k, v in sorted(eqn.params.items()):
            if hasattr(v, "eqns") or hasattr(v, "jaxpr") or isinstance(v, (list, dict)):
                return None
            try:
                hash(v)
            except TypeError:
                return None
            params.append((k, v))
        operands = tuple(
            ("lit", repr(v.val), str(v.aval)) if isinstance(v, jcore.Literal) else ("val", id(x))
            for v, x in zip(eqn.invars, ins, strict=True)
        )
        return (eqn.primitive.name, operands, tuple(params))

    def body(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))

        def read(v: Any) -> Any:
            return v.val if isinstance(v, jcore.Literal) else env[v]

        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            name = eqn.primitive.name
            key = None
            if name in CALL_PRIMITIVES and eqn.params.get("name") != "searchsorted":
                sub = eqn.params.get(CALL_PRIMITIVES[name])
                if sub is None:
                    sub = next(v for v in eqn.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr"))
                outs = body(*_as_closed(sub), ins)
            elif (key := key_of(eqn, ins)) is not None and key in seen:
                outs = seen[key]
            else:
                bound = eqn.primitive.get_bind_params(eqn.params)  # (subfuns, params) in older JAX versions
                subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
                with eqn.ctx.manager:
                    outs = eqn.primitive.bind(*subfuns, *ins, **params)
                outs = list(outs) if eqn.primitive.multiple_results else [outs]
                if key is not None:
                    seen[key] = outs
                    keep.append(ins)
            for v, o in zip(eqn.outvars, outs, strict=True):
                if not isinstance(v, jcore.DropVar):
                    env[v] = o
        return [read(v) for v in jaxpr.outvars]

    return jax.make_jaxpr(lambda *a: body(closed.jaxpr, closed.consts, a))(*specs)


def _dce(closed: Any) -> Any:
    from jax._src.interpreters import partial_eval as pe

    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
    return jcore.ClosedJaxpr(jaxpr, closed.consts)


# --- several traces, lined up ------------------------------------------------------------------------------


@dataclass
class Config:
    """One input configuration: abstract dynamic inputs and static arguments."""

    dynamic: list[tuple[tuple[int, ...], str]]
    static: list[Any]
    computation: Callable[..., Any] | None = None
    """This configuration's own reference (a task validated with changed generator knobs loads its code
    with them); None: the one `trace_reference` is given."""


@dataclass
class Traces:
    """The primary trace (the task's first TPU-scale configuration) and the others, equation by equation."""

    primary: Any
    others: list[Any]
    configs: list[Config]
    arg_names: list[str]
    n_dynamic: int
    rewritten: set[str] = field(default_factory=set)
    _var_maps: list[dict[Any, Any]] = field(default_factory=list)

    @property
    def all(self) -> list[Any]:
        return [self.primary, *self.others]

    def build_maps(self) -> None:
        """Map each primary var to the corresponding var of every other trace (same position)."""
        self._var_maps = []
        p = self.primary.jaxpr
        for other in self.others:
            o = other.jaxpr
            m: dict[Any, Any] = {}
            for a, b in zip(p.invars, o.invars, strict=True):
                m[a] = b
            for a, b in zip(p.constvars, o.constvars, strict=True):
                m[a] = b
            for ea, eb in zip(p.eqns, o.eqns, strict=True):
                for a, b in zip(ea.outvars, eb.outvars, strict=True):
                    m[a] = b
            self._var_maps.append(m)

    def shapes(self, var: Any) -> list[tuple[int, ...]]:
        """The var's shape in every trace, primary first."""
        out = [tuple(var.aval.shape)]
        for m in self._var_maps:
            out.append(tuple(m[var].aval.shape))
        return out

    def eqn_index(self, eqn: Any) -> int:
        return next(i for i, e in enumerate(self.primary.jaxpr.eqns) if e is eqn)

    def aligned_eqns(self, eqn: Any) -> list[Any]:
        i = self.eqn_index(eqn)
        return [eqn] + [t.jaxpr.eqns[i] for t in self.others]

    def unit(self, var: Any, dim: int) -> bool:
        """A dimension that is 1 in every configuration is a broadcast dimension, not an axis."""
        return all(s[dim] == 1 for s in self.shapes(var))


def structure(closed: Any) -> list[tuple[str, int, int]]:
    return [(e.primitive.name, len(e.invars), len(e.outvars)) for e in closed.jaxpr.eqns]


def trace_reference(
    computation: Callable[..., Any], configs: list[Config], arg_names: list[str], *, direct_conv: bool = False
) -> Traces:
    """Flatten the reference at every configuration; raise `Unsupported` when the structures differ.
    `direct_conv`: keep stride-1 convolutions whole for the conv family instead of im2col patches."""
    REWRITTEN.clear()
    PERMUTATIONS.clear()
    GROUPS.clear()
    SIZE_DECISIONS.reset(direct_conv=direct_conv)
    closed = []
    try:
        for cfg in configs:
            specs = [jax.ShapeDtypeStruct(s, np.dtype(_np_dtype(d))) for s, d in cfg.dynamic]
            statics = list(cfg.static)

            def fn(
                *dyn: Any,
                _statics: list[Any] = statics,
                _f: Callable[..., Any] = cfg.computation or computation,
            ) -> Any:
                return _f(*dyn, *_statics)

            SIZE_DECISIONS.start_trace(replay=bool(closed))
            closed.append(flatten(fn, specs))
    finally:
        SIZE_DECISIONS.reset(direct_conv=False)  # a rewrite used outside a trace decides for itself
    first = structure(closed[0])
    keep = [closed[0]]
    for c in closed[1:]:
        if structure(c) == first and len(c.jaxpr.outvars) == len(closed[0].jaxpr.outvars):
            keep.append(c)
        else:
            raise Unsupported(
                "the reference's structure changes with the input shapes (its jaxpr at the validation shapes "
                "has different operations from the one at the task's own shapes)"
            )
    t = Traces(
        rewritten=set(REWRITTEN),
        primary=keep[0],
        others=keep[1:],
        configs=configs,
        arg_names=arg_names,
        n_dynamic=len(configs[0].dynamic),
    )
    t.build_maps()
    return t


def _np_dtype(name: str) -> Any:
    import ml_dtypes

    return getattr(ml_dtypes, name) if hasattr(ml_dtypes, name) else name


# --- symbolic numbers --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Atom:
    """A number the generated code can name: an input's dimension or a static argument."""

    code: str  # e.g. "x.shape[1]" or "eps"
    values: tuple[float, ...]  # one per configuration
    is_dim: bool


class Resolver:
    """Find an expression over input dims and static args that gives a number in every configuration.

    The grammar is small and ordered by simplicity: a constant (same in every configuration), an atom, a
    simple function of an atom (1/a, a**-0.5, a-1, ...), then products and quotients of two or three
    atoms. The first expression that matches every configuration wins; with one configuration only, a
    number equal to an atom is named after it and anything else stays a constant.
    """

    def __init__(self, traces: Traces) -> None:
        self.n = 1 + len(traces.others)
        atoms: list[Atom] = []
        seen: set[tuple[float, ...]] = set()
        self.int_statics: set[str] = set()
        names = traces.arg_names
        nd = traces.n_dynamic
        for si in range(len(traces.configs[0].static)):
            vals = [c.static[si] for c in traces.configs]
            if all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals):
                name = names[nd + si] if nd + si < len(names) else f"static{si}"
                a = Atom(name, tuple(float(v) for v in vals), False)
                atoms.append(a)
                seen.add(a.values)
                if all(isinstance(v, int) for v in vals):
                    self.int_statics.add(name)
        for ai in range(nd):
            rank = len(traces.configs[0].dynamic[ai][0])
            for d in range(rank):
                vals = tuple(float(c.dynamic[ai][0][d]) for c in traces.configs)
                if all(v == 1 for v in vals) or vals in seen:
                    continue
                seen.add(vals)
                atoms.append(Atom(f"{names[ai]}.shape[{d}]", vals, True))
        self.atoms = atoms
        self._cache: dict[tuple[tuple[float, ...], bool], str | None] = {}

    def resolve(self, values: Sequence[float], *, integer: bool) -> str | None:
        """Code for the number, or None when it is the same constant in every configuration."""
        key = (tuple(float(v) for v in values), integer)
        if key not in self._cache:
            self._cache[key] = self._search(key[0], integer)
        return self._cache[key]

    def _search(self, values: tuple[float, ...], integer: bool) -> str | None:
        const = all(_close(v, values[0]) for v in values)
        if self.n > 1 and const:
            return None  # a constant: the caller writes the literal
        found = search(values, integer, self.atoms)
        if found is not None:
            return found
        if const:
            return None
        raise Unsupported(
            "a number in the reference changes between input configurations in a way the offline author "
            f"cannot express from the input shapes and static arguments (values {list(values)})"
        )


def search(values: Sequence[float], integer: bool, atoms: list[Atom]) -> str | None:
    """The first expression of the grammar over `atoms` that gives `values` in every configuration."""
    for code, vals in _candidates(integer, atoms):
        if all(_close(a, b) for a, b in zip(vals, values, strict=True)):
            return code
    return None


def _candidates(integer: bool, atoms: list[Atom]) -> Any:
    for a in atoms:
        yield a.code, a.values
    dims = [a for a in atoms if a.is_dim]
    if integer:
        # Floor division by another dim where it is not exact: how many whole windows fit (non-overlapping
        # patches of an image that is not a multiple of the patch), and the extent they cover. Before the
        # `a - k` forms, which fit such values on two configurations by coincidence of their remainders.
        for a, b in itertools.permutations(dims, 2):
            if all(y for y in b.values) and any(x % y for x, y in zip(a.values, b.values, strict=True)):
                floors = tuple(x // y for x, y in zip(a.values, b.values, strict=True))
                yield f"{a.code} // {b.code}", floors
                yield (
                    f"{a.code} // {b.code} * {b.code}",
                    tuple(f * y for f, y in zip(floors, b.values, strict=True)),
                )
        for a in atoms:
            for k in range(1, 33):
                yield f"{a.code} - {k}", tuple(x - k for x in a.values)
                yield f"{a.code} + {k}", tuple(x + k for x in a.values)
            yield f"{a.code} // 2", tuple(x // 2 for x in a.values)
            yield f"2 * {a.code}", tuple(2 * x for x in a.values)
        for a, b in itertools.combinations_with_replacement(dims, 2):
            yield f"{a.code} * {b.code}", tuple(x * y for x, y in zip(a.values, b.values, strict=True))
        # a dim times an integer static argument (tokens x top_k routed pairs)
        counts = [a for a in atoms if not a.is_dim and all(float(x).is_integer() for x in a.values)]
        for a, b in itertools.product(dims, counts):
            yield f"{a.code} * {b.code}", tuple(x * y for x, y in zip(a.values, b.values, strict=True))
        for a, b in itertools.permutations(dims, 2):
            if all(y and x % y == 0 for x, y in zip(a.values, b.values, strict=True)):
                yield f"{a.code} // {b.code}", tuple(x // y for x, y in zip(a.values, b.values, strict=True))
            for k in (-1, 0, 1):
                yield (
                    f"{a.code} - {b.code}" + (f" + {k}" if k > 0 else f" - {-k}" if k < 0 else ""),
                    tuple(x - y + k for x, y in zip(a.values, b.values, strict=True)),
                )
        # a dim plus a size static or another dim (a buffer padded by one group's rows: M + max_group)
        whole = [a for a in atoms if all(float(x).is_integer() for x in a.values)]
        for a, b in itertools.combinations(whole, 2):
            yield f"{a.code} + {b.code}", tuple(x + y for x, y in zip(a.values, b.values, strict=True))
        for a, b, c in itertools.combinations_with_replacement(dims, 3):
            yield (
                f"{a.code} * {b.code} * {c.code}",
                tuple(x * y * z for x, y, z in zip(a.values, b.values, c.values, strict=True)),
            )
        # a dim scaled and shifted: the extent of a transposed convolution's output (s * n + c) and of its
        # phases interleaved (`_transposed_conv_as_phases`)
        for a in dims:
            for k in range(2, 9):
                for j in range(-8, 9):
                    shift = f" {'+' if j > 0 else '-'} {abs(j)}" if j else ""
                    yield f"{k} * {a.code}{shift}", tuple(k * x + j for x in a.values)
        # padding up to a whole number of chunks (the two-level cumulative rewrite): last, so it never
        # shadows a form above
        for a in dims:
            yield f"-{a.code} % {CUMULATIVE_CHUNK}", tuple(-int(x) % CUMULATIVE_CHUNK for x in a.values)
        # how many chunks, and the padding to them, over routed pairs (a dim times an integer static: the
        # counting sort of top-k expert ids) or a dim
        spans = [(a.code, a.values) for a in dims] + [
            (f"{a.code} * {b.code}", tuple(x * y for x, y in zip(a.values, b.values, strict=True)))
            for a, b in itertools.product(dims, counts)
        ]
        for code, vals in spans:
            yield f"-(-({code}) // {CUMULATIVE_CHUNK})", tuple(-(-int(x) // CUMULATIVE_CHUNK) for x in vals)
            yield f"-({code}) % {CUMULATIVE_CHUNK}", tuple(-int(x) % CUMULATIVE_CHUNK for x in vals)
        return
    unary: list[tuple[str, Callable[[float], float]]] = [
        ("float({a})", lambda x: x),
        ("1.0 / {a}", lambda x: 1.0 / x if x else math.inf),
        ("{a} ** -0.5", lambda x: x**-0.5 if x > 0 else math.inf),
        ("{a} ** 0.5", lambda x: x**0.5 if x >= 0 else math.nan),
        ("-{a}", lambda x: -x),
        ("{a} - 1.0", lambda x: x - 1),
        ("1.0 / ({a} - 1.0)", lambda x: 1.0 / (x - 1) if x != 1 else math.inf),
        ("-float({a})", lambda x: -x),
        ("-1.0 / {a}", lambda x: -1.0 / x if x else math.inf),
        ("1.0 - {a}", lambda x: 1.0 - x),
        ("1.0 / (1.0 - {a})", lambda x: 1.0 / (1.0 - x) if x != 1 else math.inf),
    ]
    for a in atoms:
        for fmt, f in unary:
            yield fmt.format(a=a.code), tuple(f(x) for x in a.values)
    for a, b in itertools.combinations_with_replacement(atoms, 2):
        ab = tuple(x * y for x, y in zip(a.values, b.values, strict=True))
        yield f"{a.code} * {b.code}", ab
        yield f"1.0 / ({a.code} * {b.code})", tuple(1.0 / v if v else math.inf for v in ab)
        yield f"({a.code} * {b.code}) ** -0.5", tuple(v**-0.5 if v > 0 else math.inf for v in ab)
        yield f"float({a.code} * {b.code})", ab
    for a, b in itertools.permutations(atoms, 2):
        yield (
            f"{a.code} / {b.code}",
            tuple(x / y if y else math.inf for x, y in zip(a.values, b.values, strict=True)),
        )
    for a, b, c in itertools.combinations_with_replacement(dims, 3):
        abc = tuple(x * y * z for x, y, z in zip(a.values, b.values, c.values, strict=True))
        yield f"1.0 / ({a.code} * {b.code} * {c.code})", tuple(1.0 / v if v else math.inf for v in abc)
        yield f"float({a.code} * {b.code} * {c.code})", abc
    for a, b, c, d in itertools.combinations_with_replacement(dims, 4):
        abcd = tuple(x * y * z * w for x, y, z, w in zip(a.values, b.values, c.values, d.values, strict=True))
        yield (
            f"1.0 / ({a.code} * {b.code} * {c.code} * {d.code})",
            tuple(1.0 / v if v else math.inf for v in abcd),
        )
        yield f"float({a.code} * {b.code} * {c.code} * {d.code})", abcd
    # the output area of a VALID window over two dims ((H - k) * (W - k): the pixel count a global average
    # pool divides by after a VALID k+1-tap convolution), and its inverse; last, as the least simple form
    for a, b in itertools.combinations_with_replacement(dims, 2):
        for k in range(1, 8):
            area = tuple((x - k) * (y - k) for x, y in zip(a.values, b.values, strict=True))
            yield f"float(({a.code} - {k}) * ({b.code} - {k}))", area
            yield (
                f"1.0 / (({a.code} - {k}) * ({b.code} - {k}))",
                tuple(1.0 / v if v else math.inf for v in area),
            )


def _close(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= 1e-6 * max(abs(a), abs(b)) or abs(a - b) < 1e-12
