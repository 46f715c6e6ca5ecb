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


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = {}
    thunks: dict[Any, Callable[[], Any]] = {}

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
    for eqn in jaxpr.eqns:
        deferrable = (
            eqn.primitive.name in CONST_OPS
            and len(eqn.outvars) == 1
            and all(isinstance(v, jcore.Literal) or v in thunks for v in eqn.invars)
        )
        if deferrable:
            thunks[eqn.outvars[0]] = _thunk(eqn, read)
            continue
        ins = [read(v) for v in eqn.invars]
        outs = _apply(eqn, ins)
        for v, o in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, jcore.DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _thunk(eqn: Any, read: Callable[[Any], Any]) -> Callable[[], Any]:
    def run() -> Any:
        return _apply(eqn, [read(v) for v in eqn.invars])[0]

    return run


def _apply(eqn: Any, ins: list[Any]) -> list[Any]:
    name = eqn.primitive.name
    if name in CALL_PRIMITIVES and eqn.params.get("name") == "searchsorted":
        side = _searchsorted_side(eqn)
        if side is not None:
            REWRITTEN.add("searchsorted")
            return [_searchsorted_as_count(ins[0], ins[1], side, eqn.outvars[0].aval.dtype)]
    if name in CALL_PRIMITIVES:
        key = CALL_PRIMITIVES[name]
        sub = eqn.params.get(key)
        if sub is None:  # a parameter spelling this JAX version uses that the table does not know
            sub = next(v for v in eqn.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr"))
        inner, consts = _as_closed(sub)
        return _eval(inner, consts, ins)
    if name == "scan" and eqn.params["num_carry"] == 0:
        return _scan_as_vmap(eqn, ins)
    if name == "stop_gradient":
        return [ins[0]]
    if name == "conv_general_dilated" and not _direct_conv_decision(eqn, ins):
        REWRITTEN.add(name)
        return [_conv_as_patches(ins[0], ins[1], eqn.params)]
    if name in ("scatter", "scatter-add", "scatter_add") and len(ins) == 3:
        REWRITTEN.add(name)
        return [_scatter_as_masked_reduce(*ins, eqn.params, add=name != "scatter")]
    if name in CUMULATIVE:
        REWRITTEN.add(name)
        return [
            _cumulative_as_masked_reduce(ins[0], name, int(eqn.params["axis"]), bool(eqn.params["reverse"]))
        ]
    out = eqn.primitive.bind(*ins, **eqn.params)
    return list(out) if eqn.primitive.multiple_results else [out]


CUMULATIVE = {"cumsum": "sum", "cummax": "max", "cummin": "min"}
"""Cumulative ops rewritten as a masked reduction over a square of the scanned axis (see below)."""

CUMULATIVE_MAX_LEN = 4096
"""Longest scanned axis for that rewrite: each output element reads the whole axis (n² work), which is
cheap next to the rest of a kernel for chunk-sized axes and group counts, and wasteful beyond."""


def _cumulative_as_masked_reduce(x: Any, name: str, axis: int, reverse: bool) -> Any:
    """`cumsum(x, axis)[.., i, ..] = sum_j x[.., j, ..] * (j <= i)`: a broadcast, an iota mask and a
    reduction, which the kernel families already fuse into the kernel that produces or consumes `x` (a
    prefix sum has no TPU vector primitive; a masked reduction over a VMEM-resident axis does)."""
    import jax.numpy as jnp
    from jax import lax

    n = x.shape[axis]
    if n > CUMULATIVE_MAX_LEN:
        raise Unsupported(
            f"a cumulative {CUMULATIVE[name]} along an axis of {n} elements (at most {CUMULATIVE_MAX_LEN})"
        )
    rank = x.ndim
    i = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    j = lax.broadcasted_iota(jnp.int32, (n, n), 1)
    mask = (j >= i) if reverse else (j <= i)  # [i, j]: does x[j] count towards out[i]
    shape = (*x.shape[:axis], n, n, *x.shape[axis + 1 :])
    # lax, not jnp.where: the flattened jaxpr must not gain calls (jnp.where is a jitted function)
    mask = lax.broadcast_in_dim(mask, shape, (axis, axis + 1))
    xj = lax.broadcast_in_dim(
        x, shape, tuple(d if d < axis else d + 1 for d in range(rank))
    )  # [.., i, j, ..]
    if name == "cumsum":
        fill = jnp.zeros(shape, x.dtype)
        return lax.reduce(lax.select(mask, xj, fill), np.zeros((), x.dtype), lax.add, (axis + 1,))
    if jnp.issubdtype(x.dtype, jnp.floating):
        value = -np.inf if name == "cummax" else np.inf
    else:
        info = jnp.iinfo(x.dtype)
        value = info.min if name == "cummax" else info.max
    fill = jnp.full(shape, value, x.dtype)
    masked = lax.select(mask, xj, fill)
    return lax.reduce_max(masked, (axis + 1,)) if name == "cummax" else lax.reduce_min(masked, (axis + 1,))


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
    if n_rows * n_upd * max(1, math.prod(window)) > SCATTER_MAX_ELEMS:
        raise Unsupported(f"a scatter of {n_upd} rows into {n_rows} (too large for a one-hot reduction)")
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


def _searchsorted_as_count(sorted_arr: Any, query: Any, side: str, dtype: Any) -> Any:
    """The insertion index of `query` in a sorted 1-D array is how many entries precede it: a comparison
    against every entry and a sum, the same answer as the binary search for sorted input (NaN ordering
    aside). The search's loop cannot run in a kernel; the count is a map and a reduction."""
    import jax.numpy as jnp

    a = sorted_arr.reshape((1,) * query.ndim + (sorted_arr.shape[0],))
    q = jnp.expand_dims(query, query.ndim)
    before = (a <= q) if side == "right" else (a < q)
    return jnp.sum(before.astype(jnp.int32), axis=-1).astype(dtype)


def _scan_as_vmap(eqn: Any, ins: list[Any]) -> list[Any]:
    """`lax.map(f, xs)` is a scan without a carry: every iteration is independent, so it is `vmap(f)(xs)`."""
    body, body_consts = _as_closed(eqn.params["jaxpr"])
    n_consts = eqn.params["num_consts"]
    consts, xs = ins[:n_consts], ins[n_consts:]

    def one(*x: Any) -> list[Any]:
        return _eval(body, body_consts, [*consts, *x])

    return list(jax.vmap(one)(*xs))


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
class _DirectConv:
    """Set by `trace_reference(direct_conv=True)`: convolutions `direct_conv_ok` accepts stay one primitive
    (the conv family's kernel) instead of becoming patches + a matmul. The first (TPU-scale) trace decides
    for each convolution in order, and the other configurations replay those decisions, so every trace has
    the same structure."""

    enabled: bool = False
    decisions: list[bool] = field(default_factory=list)
    replay: bool = False
    position: int = 0


DIRECT_CONV = _DirectConv()


def _direct_conv_decision(eqn: Any, ins: list[Any]) -> bool:
    d = DIRECT_CONV
    if not d.enabled:
        return False
    if d.replay:
        if d.position >= len(d.decisions):
            return False  # a convolution the primary trace did not have: the structures differ anyway
        d.position += 1
        return d.decisions[d.position - 1]
    ok = direct_conv_ok(eqn.params, tuple(ins[0].shape), np.dtype(ins[0].dtype).itemsize, tuple(ins[1].shape))
    d.decisions.append(ok)
    return ok


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
    # (N, O..., C_out) -> out_spec layout
    perm = [0] * (nsp + 2)
    perm[out_spec[0]] = 0
    perm[out_spec[1]] = nsp + 1
    for i in range(nsp):
        perm[out_spec[2 + i]] = 1 + i
    return jnp.transpose(y, perm)


def flatten(fn: Callable[..., Any], specs: Sequence[jax.ShapeDtypeStruct]) -> Any:
    """A `ClosedJaxpr` of `fn` with calls inlined, `lax.map` vectorised and dead equations dropped."""
    closed = jax.make_jaxpr(fn)(*specs)

    def run(*args: Any) -> list[Any]:
        return _eval(closed.jaxpr, closed.consts, args)

    flat = jax.make_jaxpr(run)(*specs)
    return _dce(flat)


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
    DIRECT_CONV.enabled, DIRECT_CONV.decisions, DIRECT_CONV.replay = direct_conv, [], False
    closed = []
    for cfg in configs:
        specs = [jax.ShapeDtypeStruct(s, np.dtype(_np_dtype(d))) for s, d in cfg.dynamic]
        statics = list(cfg.static)

        def fn(*dyn: Any, _statics: list[Any] = statics) -> Any:
            return computation(*dyn, *_statics)

        DIRECT_CONV.replay, DIRECT_CONV.position = bool(closed), 0
        closed.append(flatten(fn, specs))
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
        for a in atoms:
            for k in range(1, 33):
                yield f"{a.code} - {k}", tuple(x - k for x in a.values)
                yield f"{a.code} + {k}", tuple(x + k for x in a.values)
            yield f"{a.code} // 2", tuple(x // 2 for x in a.values)
            yield f"2 * {a.code}", tuple(2 * x for x in a.values)
        for a, b in itertools.combinations_with_replacement(dims, 2):
            yield f"{a.code} * {b.code}", tuple(x * y for x, y in zip(a.values, b.values, strict=True))
        for a, b in itertools.permutations(dims, 2):
            if all(y and x % y == 0 for x, y in zip(a.values, b.values, strict=True)):
                yield f"{a.code} // {b.code}", tuple(x // y for x, y in zip(a.values, b.values, strict=True))
            for k in (-1, 0, 1):
                yield (
                    f"{a.code} - {b.code}" + (f" + {k}" if k > 0 else f" - {-k}" if k < 0 else ""),
                    tuple(x - y + k for x, y in zip(a.values, b.values, strict=True)),
                )
        for a, b, c in itertools.combinations_with_replacement(dims, 3):
            yield (
                f"{a.code} * {b.code} * {c.code}",
                tuple(x * y * z for x, y, z in zip(a.values, b.values, c.values, strict=True)),
            )
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


def _close(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= 1e-6 * max(abs(a), abs(b)) or abs(a - b) < 1e-12
