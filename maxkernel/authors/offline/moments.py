"""One-pass moments of a convolution's output: the centred sum of squares from the plain one.

A batch / instance norm after a convolution reduces the conv output twice, and the second reduction needs
the first's result:

    s = sum(y, A);  mean = s / n;  m2 = sum(square(y - mean), A)        (A: the spatial dims [+ batch])

so the conv kernel cannot compute `m2` while it produces `y`: the mean is known only after the last grid
step. Written this way the program makes three passes over `y` in HBM (the two reductions, then the
normalisation), where XLA makes the same three. The identity

    sum((y - mean)^2, A) = sum(y^2, A) - mean * s        (mean = s / n, n the reduced count)

turns `m2` into a reduction of `square(y)`, a sibling of `s`: both run in the conv kernel's epilogue on the
f32 accumulator in VMEM, and only the normalisation reads `y` back. This is the moment computation XLA's own
batch-norm expander uses (Var = E[y^2] - E[y]^2). It is exact algebra; in floating point it loses relative
accuracy when the mean is large against the standard deviation (mean^2 / var ~ 1/eps_f32), which a conv
output normalised by its own statistics rarely is; the result is clamped at 0 so `rsqrt(var + eps)` stays
finite, and the harness checks every kernel against the reference at the task's tolerance.

A group norm splits the channels first, `reshape(y, (N, *S, G, C // G))`, and reduces over `S` and the
group's members: the same moments, summed per channel in the conv kernel and then per group in a tiny
kernel, and the normalisation is evaluated on `y` itself with the group statistics repeated per channel,
so the split layout (a relayout copy of the whole tensor on a TPU) never exists (`_Grouped`).

Only applied where it removes a pass: the centred value is a convolution kept whole for the conv family
(seen through a per-channel bias or scale, which its epilogue computes) and the reduced axes are its
spatial dims, with or without the batch dim. A row that a kernel holds whole in VMEM gains nothing from
it, and keeps the two-pass form.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax.extend import core as jcore

from maxkernel.tools.jaxpr import use_counts

SQUARES = frozenset({"square", "integer_pow", "mul"})
MEAN_LAYOUT = frozenset({"broadcast_in_dim", "reshape", "expand_dims"})


@dataclass(frozen=True)
class CentredSquares:
    """`sum(square(y - h), axes)` with `h` the mean of `y` over the same axes (`h = s / n`, `s` = `s_var`)."""

    y: Any  # the conv output
    s: Any  # reduce_sum(y, axes)
    h: Any  # s / n, broadcast with size-1 dims at `axes`
    axes: tuple[int, ...]
    divide: Any = None  # the equation dividing by n on the way from s to h
    d: Any = None  # y - h
    square: Any = None  # the equation squaring d


def _is_lit(v: Any) -> bool:
    return isinstance(v, jcore.Literal)


class OnePassMoments:
    """Finds `sum(square(y - mean(y)))` over a conv output's spatial (+ batch) dims in one jaxpr and
    evaluates it as `sum(square(y)) - mean * sum(y)`; a group norm's grouped form is evaluated per channel
    (see `_Grouped`). See the module docstring."""

    def __init__(self, jaxpr: Any, conv_ok: Callable[[Any, int, bool], bool]) -> None:
        """`conv_ok(conv_eqn, count, grouped)`: is this convolution kept whole for the conv family, and is a
        pass saved by accumulating `count` elements per statistic in its epilogue (a plain or grouped norm)?"""
        uses = use_counts(jaxpr)
        producer = {v: e for e in jaxpr.eqns for v in e.outvars}
        self.rewrites: dict[Any, Callable[[Callable[[Any], Any]], Any]] = {}
        for eqn in jaxpr.eqns:
            pattern = _match(eqn, producer, uses)
            if pattern is None:
                continue
            conv, perm = _conv_behind(pattern.y, producer)
            if conv is not None and conv_moments_axes_ok(conv, tuple(perm[a] for a in pattern.axes)):
                if conv_ok(conv, _count(pattern.y, pattern.axes), False):
                    self.rewrites[eqn.outvars[0]] = functools.partial(_plain_m2, pattern)
                continue
            grouped = _Grouped.of(pattern, producer, uses)
            if grouped is None:
                continue
            conv, perm = _conv_behind(grouped.src, producer)
            if (
                conv is not None
                and conv_moments_axes_ok(conv, tuple(perm[a] for a in grouped.axes))
                and conv_ok(conv, _count(pattern.y, pattern.axes), True)
            ):
                self.rewrites[pattern.s] = grouped.first_sum
                for s in grouped.sums:
                    self.rewrites[s] = grouped.first_sum
                sums = [pattern.s, eqn.outvars[0], *grouped.sums]
                for d in _count_divisions(jaxpr, producer, sums, pattern.divide):
                    self.rewrites[d.outvars[0]] = functools.partial(grouped.per_count, d)
                self.rewrites[eqn.outvars[0]] = grouped.m2
                if grouped.merge is not None:
                    self.rewrites[grouped.merge.outvars[0]] = grouped.normalised

    def apply(self, eqn: Any, read: Callable[[Any], Any]) -> Any | None:
        """The equation's single result in its one-pass form, or None to evaluate it as usual."""
        if len(eqn.outvars) != 1 or eqn.outvars[0] not in self.rewrites:
            return None
        return self.rewrites[eqn.outvars[0]](read)


def _count_divisions(jaxpr: Any, producer: dict[Any, Any], sums: list[Any], first: Any) -> list[Any]:
    """The divisions by the reduced count (the mean's and the variance's) of these sums, seen through
    layout ops: `first` (the mean's, already found) and any other with the same literal."""
    found = [first]
    for e in jaxpr.eqns:
        if e is first or e.primitive.name != "div" or _is_lit(e.invars[0]):
            continue
        if _const(e.invars[1], producer) != float(first.invars[1].val):
            continue
        v = e.invars[0]
        while v not in sums and (p := producer.get(v)) is not None and p.primitive.name in MEAN_LAYOUT:
            v = p.invars[0]
        if v in sums:
            found.append(e)
    return found


def _const(v: Any, producer: dict[Any, Any]) -> float | None:
    """A number known at trace time: a literal, or `jnp.var`'s divisor `n - ddof` (a `sub` of two literals,
    maybe cast)."""
    if _is_lit(v):
        return float(v.val)
    e = producer.get(v)
    if e is None or e.primitive.name not in ("sub", "convert_element_type"):
        return None
    vals = [_const(u, producer) for u in e.invars]
    if any(x is None for x in vals):
        return None
    return vals[0] - vals[1] if e.primitive.name == "sub" else vals[0]


def _count(v: Any, axes: tuple[int, ...]) -> int:
    return math.prod(int(v.aval.shape[a]) for a in axes)


def _reduce_sum(x: Any, axes: tuple[int, ...]) -> Any:
    from jax import lax

    return lax.reduce_sum_p.bind(x, axes=tuple(axes), out_sharding=None)


def _plain_m2(p: CentredSquares, read: Callable[[Any], Any]) -> Any:
    """sum((y - h)^2) = sum(y^2) - h * s, with h = s / n; for a low-precision y (a bf16 program: its mean h
    rounded to bf16, so not exactly s / n) the general sum(y^2) - 2 h s + n h^2, all in float32."""
    import jax.numpy as jnp

    y, s, h = read(p.y), read(p.s), read(p.h)
    if np.dtype(p.y.aval.dtype) == np.float32:
        return jnp.maximum(_reduce_sum(jnp.square(y), p.axes) - jnp.reshape(h, s.shape) * s, 0.0)
    y32, s32 = y.astype(jnp.float32), s.astype(jnp.float32)
    h32 = jnp.reshape(h, s.shape).astype(jnp.float32)
    n = float(_count(p.y, p.axes))
    return jnp.maximum(_reduce_sum(jnp.square(y32), p.axes) - 2.0 * h32 * s32 + n * h32 * h32, 0.0)


ELEMENTWISE = frozenset(
    """add sub mul div max min neg abs sign exp exp2 expm1 log log1p tanh logistic erf sqrt rsqrt cbrt square
    integer_pow pow sin cos floor ceil round select_n clamp convert_element_type is_finite eq ne lt le gt ge
    and or not""".split()
)
"""Elementwise ops a conv kernel's epilogue computes on its accumulator (an activation such as Mish or
GELU, a bias, a scale): a statistic of their result is still accumulated in the conv kernel's pass."""


def _small(v: Any) -> bool:
    """A scalar or one vector (a bias or a scale), whatever dim it is along."""
    dims = [int(d) for d in v.aval.shape]
    return math.prod(dims) <= max((*dims, 1))


def _elementwise_root(var: Any, producer: dict[Any, Any]) -> Any | None:
    """The one full-shape value `var` is an elementwise function of (with literals, scalars and vectors
    beside it), seen through a DAG of elementwise ops (`y * tanh(softplus(y))` reads `y` twice); None when
    it reads two full-shape values or anything else."""
    shape = tuple(int(d) for d in var.aval.shape)
    roots: set[Any] = set()
    seen: set[Any] = set()
    stack = [var]
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        e = producer.get(v)
        if v is not var and (e is None or e.primitive.name not in ELEMENTWISE):
            roots.add(v)
            continue
        if e is None or e.primitive.name not in ELEMENTWISE:
            return None
        for u in e.invars:
            if _is_lit(u):
                continue
            if tuple(int(d) for d in u.aval.shape) == shape:
                stack.append(u)
            elif not _small(u):
                return None
        if len(roots) > 1:
            return None
    return next(iter(roots)) if len(roots) == 1 else None


PRODUCERS = frozenset({"conv_general_dilated", "dot_general"})


def _conv_behind(var: Any, producer: dict[Any, Any]) -> tuple[Any | None, tuple[int, ...]]:
    """The convolution (or matmul) whose output `var` is, seen through elementwise work on it that the kernel's
    epilogue computes on its accumulator (a bias, a scale, a cast, an activation) and through transposes (the
    NHWC -> NCHW one of PyTorch-layout code, a view of the same block to the kernel); with, per dim of `var`,
    the conv-output dim it is."""
    perm = tuple(range(len(var.aval.shape)))
    while True:
        e = producer.get(var)
        if e is None:
            return None, perm
        if e.primitive.name in PRODUCERS:
            return e, perm
        if e.primitive.name == "transpose" and not _is_lit(e.invars[0]):
            order = tuple(int(a) for a in e.params["permutation"])
            perm = tuple(order[p] for p in perm)
            var = e.invars[0]
            continue
        root = _elementwise_root(var, producer)
        if root is None:
            return None, perm
        var = root


@dataclass(frozen=True)
class _Grouped:
    """A group norm written the usual way: the value `src` with its channel dim split in two,
    `y = reshape(src, (N, *S, G, C // G))` channels-last or `(N, G, C // G, *S)` channels-first (PyTorch
    layout), its statistics over `S` and the group's members, and the normalised value (an elementwise chain
    from the split value with group statistics beside it, `(y - mean) / sqrt(var + eps)`) reshaped back to
    (N, *S, C). Evaluated per channel instead: the spatial sums of `src` and `src^2` per (N, C) (what the
    conv kernel accumulates), summed over each group's channels (a tiny reduction), and the normalisation on
    `src` itself with the group statistics repeated per channel, so the (..., G, C // G) layout (a relayout
    copy on a TPU, whose minor dims it breaks up) never exists.

    A bf16 program (`jnp.mean` / `jnp.var` of a bf16 value) sums a float32 cast of the split value, and its
    normalisation is bf16 arithmetic on the split value and the mean rounded to bf16: the sums are taken of
    the same cast of `src`, and the chain replays each op on the same operand values (a group's statistic
    repeated per channel is the same number), so it rounds exactly as the reference does."""

    pattern: CentredSquares  # over the split value (or its widening cast): y, its first sum s, the mean h
    src: Any
    split: Any  # reshape(src): y itself, or the value y widens
    axes: tuple[int, ...]  # reduced axes of src (the split value's, less the group-member axis)
    groups: int
    chan: int  # src's channel dim (split into the group dim `chan` and the member dim `chan + 1` of y)
    merge: Any | None  # reshape(v) back to src's shape, v the normalised value
    chain: tuple[tuple[Any, int], ...]  # the elementwise ops from the split value to v: (eqn, chain operand)
    sums: tuple[Any, ...]  # other sums of the split value over the same axes (the mean beside `jnp.var`'s)

    @staticmethod
    def of(p: CentredSquares, producer: dict[Any, Any], uses: dict[Any, int]) -> _Grouped | None:
        split_var = p.y
        split = producer.get(p.y)
        if split is not None and _widening(split) and not _is_lit(split.invars[0]):
            split_var = split.invars[0]
            split = producer.get(split_var)
        if split is None or split.primitive.name != "reshape" or _is_lit(split.invars[0]):
            return None
        src = split.invars[0]
        src_shape = tuple(int(d) for d in src.aval.shape)
        y_shape = tuple(int(d) for d in p.y.aval.shape)
        if len(y_shape) != len(src_shape) + 1:
            return None
        ch = next((d for d in range(len(src_shape)) if y_shape[d] != src_shape[d]), len(src_shape) - 1)
        if y_shape[:ch] != src_shape[:ch] or y_shape[ch + 2 :] != src_shape[ch + 1 :]:
            return None
        if y_shape[ch] * y_shape[ch + 1] != src_shape[ch] or ch + 1 not in p.axes or ch in p.axes:
            return None
        src_axes = tuple(a if a < ch else a - 1 for a in p.axes if a != ch + 1)
        if any(d not in src_axes for d in range(ch + 1, len(src_shape))):
            return None  # the channel dim is the last one kept: per-channel sums are (..., C)
        if len(src_axes) > 2:
            # `per_count` divides by the reduced spatial count, a literal the generated code must name from
            # the input shapes: a product of two conv output dims ((H - 2) * (W - 2)) is in the resolver's
            # grammar, a product of three (a 3-D conv's D x H x W) is not, and the lowering would fail
            return None
        if not _floating(src.aval.dtype) or np.dtype(src.aval.dtype).itemsize > 4:
            return None
        # the split value's views: itself and its widening casts (each library reduction casts it again)
        views = {split_var, p.y} | {
            e.outvars[0] for e in producer.values() if e.invars and e.invars[0] is split_var and _widening(e)
        }
        sums = tuple(
            e.outvars[0]
            for e in producer.values()
            if e.primitive.name == "reduce_sum"
            and e.invars[0] in views
            and e.outvars[0] is not p.s
            and tuple(sorted(int(a) for a in e.params["axes"])) == p.axes
        )
        group_shape = tuple(int(d) for d in p.h.aval.shape)
        merge, chain = None, ()
        for e in producer.values():  # the normalised value, reshaped back to src's shape
            if e.primitive.name != "reshape" or tuple(int(d) for d in e.outvars[0].aval.shape) != src_shape:
                continue
            if _is_lit(e.invars[0]) or e.invars[0] in views:
                continue
            found = _group_chain(e.invars[0], views, y_shape, group_shape, producer, uses, p)
            if found:
                merge, chain = e, found
        return _Grouped(
            pattern=p,
            src=src,
            split=split_var,
            axes=src_axes,
            groups=y_shape[ch],
            chan=ch,
            merge=merge,
            chain=chain,
            sums=sums,
        )

    def _per_group(self, per_channel: Any) -> Any:
        """(..., C) sums -> (..., G): each group's channels summed."""
        import jax.numpy as jnp

        c = per_channel.shape[-1]
        return _reduce_sum(
            jnp.reshape(per_channel, (*per_channel.shape[:-1], self.groups, c // self.groups)),
            (per_channel.ndim,),
        )

    def _wide_src(self, read: Callable[[Any], Any]) -> Any:
        """`src` in the statistics' dtype (float32: a bf16 program's reductions sum a cast of it)."""
        x = read(self.src)
        return x.astype(self.pattern.y.aval.dtype)

    def first_sum(self, read: Callable[[Any], Any]) -> Any:
        return self._per_group(_reduce_sum(self._wide_src(read), self.axes))

    def per_count(self, div: Any, read: Callable[[Any], Any]) -> Any:
        """A group sum (of values or squares) divided by the group's channel count, then by the reduced
        spatial (+ batch) count: two numbers a kernel names from the shapes (C // G and H * W), where their
        product may not be one it can name."""
        members = self.src.aval.shape[self.chan] // self.groups
        return read(div.invars[0]) / float(members) / (float(self.pattern.divide.invars[1].val) / members)

    def m2(self, read: Callable[[Any], Any]) -> Any:
        import jax.numpy as jnp

        ssq = self._per_group(_reduce_sum(jnp.square(self._wide_src(read)), self.axes))
        s, h = read(self.pattern.s), read(self.pattern.h)
        return jnp.maximum(ssq - jnp.reshape(h, s.shape) * s, 0.0)

    def _per_channel(self, t: Any) -> Any:
        """Group values with size-1 dims at the reduced axes, (..., G, 1, ...) with G at the channel dim ->
        (..., C, ...): repeated over each group's channels."""
        import jax.numpy as jnp

        k, c = self.chan, self.src.aval.shape[self.chan]
        if t.shape[k] == 1:  # one value for every group
            return jnp.reshape(t, (*t.shape[:k], 1, *t.shape[k + 2 :]))
        full = (*t.shape[: k + 1], c // self.groups, *t.shape[k + 2 :])
        return jnp.reshape(jnp.broadcast_to(t, full), (*t.shape[:k], c, *t.shape[k + 2 :]))

    def normalised(self, read: Callable[[Any], Any]) -> Any:
        """The chain replayed on `src`, each group operand repeated per channel."""
        first_eqn, first_k = self.chain[-1]
        start = first_eqn.invars[first_k]
        x = read(self.src)
        if start is not self.split:
            x = x.astype(start.aval.dtype)
        for e, k in reversed(self.chain):
            ins = []
            for j, v in enumerate(e.invars):
                if j == k:
                    ins.append(x)
                elif _is_lit(v) or not v.aval.shape:
                    ins.append(read(v))
                else:
                    ins.append(self._per_channel(read(v)))
            x = e.primitive.bind(*ins, **e.params)
        return x


CHAIN_OPS = frozenset({"add", "sub", "mul", "div", "max", "min", "convert_element_type"})


def _floating(dtype: Any) -> bool:
    import jax.numpy as jnp

    return bool(jnp.issubdtype(dtype, jnp.floating))


def _widening(e: Any) -> bool:
    """A float cast to a float at least as wide (bf16 -> f32): exact."""
    if e.primitive.name != "convert_element_type":
        return False
    src, dst = e.invars[0].aval.dtype, e.outvars[0].aval.dtype
    return _floating(src) and _floating(dst) and np.dtype(dst).itemsize >= np.dtype(src).itemsize


def _group_chain(
    v: Any,
    views: set[Any],
    y_shape: tuple[int, ...],
    group_shape: tuple[int, ...],
    producer: dict[Any, Any],
    uses: dict[Any, int],
    p: CentredSquares,
) -> tuple[tuple[Any, int], ...]:
    """The elementwise ops (CHAIN_OPS) from a view of the split value to `v`, each with one full-shape
    operand (the chain) and the others literals, scalars or group-shaped values (a statistic per group):
    (eqn, chain operand) from `v` back; empty if `v` is not such a chain. Each value on it is used by the
    next op alone (the centred difference may also feed the square that the one-pass form rewrites)."""
    chain: list[tuple[Any, int]] = []
    ones = (1,) * len(y_shape)
    while v not in views:
        e = producer.get(v)
        allowed = 1 + (v is p.d) * (1 + (p.square is not None and p.square.primitive.name == "mul"))
        if e is None or e.primitive.name not in CHAIN_OPS or uses.get(v) != allowed or len(e.outvars) != 1:
            return ()
        if e.primitive.name == "convert_element_type" and not _floating(e.outvars[0].aval.dtype):
            return ()
        full = [j for j, u in enumerate(e.invars) if not _is_lit(u) and tuple(u.aval.shape) == y_shape]
        if len(full) != 1:
            return ()
        for j, u in enumerate(e.invars):
            if j == full[0] or _is_lit(u) or not u.aval.shape:
                continue
            if tuple(int(d) for d in u.aval.shape) not in (group_shape, ones):
                return ()
        chain.append((e, full[0]))
        v = e.invars[full[0]]
    return tuple(chain)


def _match(eqn: Any, producer: dict[Any, Any], uses: dict[Any, int]) -> CentredSquares | None:
    if eqn.primitive.name != "reduce_sum" or len(eqn.outvars) != 1:
        return None
    axes = tuple(sorted(int(a) for a in eqn.params["axes"]))
    sq_var = eqn.invars[0]
    sq = producer.get(sq_var)
    if sq is not None and uses.get(sq_var) == 1 and _widening(sq) and not _is_lit(sq.invars[0]):
        sq_var = sq.invars[0]  # a bf16 program sums a float32 cast of its bf16 squares
        sq = producer.get(sq_var)
    if sq is None or uses.get(sq_var) != 1 or sq.primitive.name not in SQUARES:
        return None
    if sq.primitive.name == "integer_pow" and int(sq.params["y"]) != 2:
        return None
    if sq.primitive.name == "mul" and (sq.invars[0] is not sq.invars[1] or _is_lit(sq.invars[0])):
        return None
    d_var = sq.invars[0]
    sub = producer.get(d_var)
    # `y - mean` may have other uses (the normalisation computes the same difference, and a program traced
    # with its repeats merged reads it from one equation): they keep it; only its square is rewritten
    if (
        sub is None
        or uses.get(d_var, 0) < (2 if sq.primitive.name == "mul" else 1)
        or sub.primitive.name != "sub"
    ):
        return None
    y, h = sub.invars
    if _is_lit(y) or _is_lit(h) or not _floating(y.aval.dtype) or np.dtype(y.aval.dtype).itemsize > 4:
        return None
    shape = tuple(int(d) for d in y.aval.shape)
    h_shape = tuple(int(d) for d in h.aval.shape)
    if len(h_shape) != len(shape) or any(h_shape[a] != 1 for a in axes):
        return None
    if any(h_shape[d] != shape[d] for d in range(len(shape)) if d not in axes):
        return None
    count = int(np.prod([shape[a] for a in axes]))
    # h = broadcast(s) / count, s = reduce_sum(y, axes): layout ops and exactly one division by the count
    v, divided, div_eqn = h, False, None
    while True:
        e = producer.get(v)
        if e is None:
            return None
        name = e.primitive.name
        if name in MEAN_LAYOUT or (name == "convert_element_type" and _floating(e.outvars[0].aval.dtype)):
            v = e.invars[0]  # layout, and a bf16 program's rounding of its float32 mean
            continue
        if name == "div" and not divided and _is_lit(e.invars[1]) and float(e.invars[1].val) == count:
            v, divided, div_eqn = e.invars[0], True, e
            continue
        summed = e.invars[0] if name == "reduce_sum" else None
        if (
            summed is not None
            and summed is not y
            and (c := producer.get(summed)) is not None
            and _widening(c)
        ):
            summed = c.invars[0]  # the sum of a float32 cast of y
        if name == "reduce_sum" and divided and summed is y:
            if tuple(sorted(int(a) for a in e.params["axes"])) != axes:
                return None
            s_shape = tuple(int(d) for d in e.outvars[0].aval.shape)
            if s_shape != tuple(shape[d] for d in range(len(shape)) if d not in axes):
                return None
            return CentredSquares(y=y, s=e.outvars[0], h=h, axes=axes, divide=div_eqn, d=d_var, square=sq)
        return None


def conv_moments_axes_ok(conv_eqn: Any, axes: tuple[int, ...]) -> bool:
    """The reduced axes are the conv output's spatial dims, with or without its batch dim; a matmul's: its
    rows (the lhs's free dims, which its kernel walks as the sequential M axis), with or without its batch
    dims (a batch norm over a linear layer's output)."""
    if conv_eqn.primitive.name == "dot_general":
        (lc, _), (lb, _) = conv_eqn.params["dimension_numbers"]
        n_free = len(conv_eqn.invars[0].aval.shape) - len(lc) - len(lb)
        rows = set(range(len(lb), len(lb) + n_free))
        return bool(rows) and set(axes) in (rows, rows | set(range(len(lb))))
    spec = conv_eqn.params["dimension_numbers"].out_spec
    spatial = {int(d) for d in spec[2:]}
    return set(axes) in (spatial, spatial | {int(spec[0])})
