"""Grouped-query attention without the K/V head repeat: the repeated head axis split into (K/V head, group).

Grouped-query attention stores `Hkv` K/V heads and lets `G = Hq / Hkv` query heads share each. References
written the textbook way expand K and V to `Hq` heads first:

    k = jnp.repeat(k, G, axis=2)          # [B, S, Hkv, D] -> [B, S, Hkv * G, D]: broadcast + merging reshape

and then run plain multi-head attention. Traced as it is, the repeat is a value of its own: XLA glue writes
`G` copies of K and of V to HBM (Llama-3-405B at S=4096: 537 MB each, re-read by the kernel), and the
attention kernel walks `Hq` heads, fetching the same K/V block once per query head.

The repeat's layout says which query heads share a K/V head: merging `(Hkv, G)` with `G` minor gives head
`h = kv * G + g` (`jnp.repeat`'s order). This rewrite carries every value on that head axis in a *split*
form, the axis replaced by two, `(Hkv, G)`: the repeated K/V is its source with a unit `G` axis (no copy),
a query-side value is reshaped (a free view of a contiguous axis: `[B, S, Hq, D] -> [B, S, Hkv, G, D]`), and
each dot whose batch axis is the head pairs the K/V head and turns `G` into a free axis of the query side.
The attention family then sees `G` as query-only rows and folds the group into one block
(`AttentionBuilder.shared_kv_rows`): each K/V block is fetched once per group, and nothing is repeated.

Followed through transposes, elementwise maps, broadcasts, reductions over other axes and dots batched on
the head; any other use reads the value in its original shape (the split value merged back: a view, or
for the repeated K/V the repeat itself, which the dead-code pass drops when nothing reads it). Applied only
where a repeat reaches a dot, so programs without grouped heads trace exactly as before; decided from the
program's structure alone, so every input configuration traces the same operations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jax import lax
from jax.extend import core as jcore

from maxkernel.tools.jaxpr import ELEMENTWISE

MAPS = ELEMENTWISE | {"convert_element_type", "copy", "copy_p"}
"""Same-shape maps a split value goes through as it is."""

REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min"})

PASS_THROUGH = frozenset({"transpose", "convert_element_type", "copy", "copy_p"})
"""What a repeated K/V may go through on its way to a dot for the rewrite to apply."""


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in v.aval.shape)


def _nonunit(shape: tuple[int, ...]) -> list[int]:
    return [d for d, n in enumerate(shape) if n != 1]


def _unit_only(src: tuple[int, ...], dst: tuple[int, ...]) -> dict[int, int] | None:
    """For a reshape that only inserts or removes unit dims: each dim of `src` that has a place in `dst` ->
    that place. Non-unit dims pair in order; unit dims pair within the same gap between non-unit dims,
    from the right, so the pairing does not depend on whether a broadcast dim happens to be 1 at these
    sizes (a K/V repeat of 1: the same dims pair as at a repeat of 8)."""
    a, b = _nonunit(src), _nonunit(dst)
    if [src[d] for d in a] != [dst[d] for d in b]:
        return None
    out = dict(zip(a, b, strict=True))
    bounds_a, bounds_b = [-1, *a, len(src)], [-1, *b, len(dst)]
    for k in range(len(bounds_a) - 1):
        gap_a = list(range(bounds_a[k] + 1, bounds_a[k + 1]))
        gap_b = list(range(bounds_b[k] + 1, bounds_b[k + 1]))
        for x, y in zip(reversed(gap_a), reversed(gap_b), strict=False):
            out[x] = y
    return out


def _merges(src: tuple[int, ...], dst: tuple[int, ...]) -> list[int]:
    """Dims `p` such that the reshape merges `src[p], src[p + 1]` into `dst[p]` and changes nothing else."""
    if len(src) != len(dst) + 1:
        return []
    return [
        p
        for p in range(len(dst))
        if src[:p] == dst[:p] and src[p] * src[p + 1] == dst[p] and src[p + 2 :] == dst[p + 1 :]
    ]


def _ex(d: int, axis: int) -> int:
    """A dim of the original value -> its dim in the split form (the head axis itself -> the K/V head)."""
    return d if d <= axis else d + 1


def _split_map(dims: list[int], axis: int) -> tuple[int, ...]:
    """A permutation or broadcast mapping into dims of a value whose `axis` is split: `axis` becomes the
    pair (axis, axis + 1), every other dim shifts past it."""
    out: list[int] = []
    for d in dims:
        out += [axis, axis + 1] if d == axis else [_ex(d, axis)]
    return tuple(out)


def _rebroadcast(eqn: Any, x: Any, shape: tuple[int, ...], dims: Sequence[int]) -> Any:
    """`eqn` (a broadcast_in_dim) bound again with a new result shape and mapping, its other params kept."""
    params = dict(eqn.params, shape=tuple(shape), broadcast_dimensions=tuple(dims))
    return eqn.primitive.bind(x, **params)


@dataclass(frozen=True)
class Split:
    """A value on a split head axis: `value` has `axis` (size `groups * size` originally) replaced by
    `(groups, size)`, or `(groups, 1)` when `unit` (a repeated K/V: the same for every query of a group)."""

    value: Any
    axis: int
    groups: int
    size: int
    unit: bool

    def shape(self, orig: tuple[int, ...], unit: bool | None = None) -> tuple[int, ...]:
        g = 1 if (self.unit if unit is None else unit) else self.size
        return (*orig[: self.axis], self.groups, g, *orig[self.axis + 1 :])


class _Refused(Exception):
    """This use of a split value is not one the rewrite follows: it reads the merged value instead."""


class HeadGroups:
    """The rewrite above, for one flat jaxpr being re-traced by `trace._eval` (see the module docstring)."""

    def __init__(
        self,
        jaxpr: Any,
        read: Callable[[Any], Any],
        decide: Callable[[Callable[[], list[tuple[int, int, int]]]], list[tuple[int, int, int]]]
        | None = None,
    ) -> None:
        self.read = read
        self.producer: dict[Any, Any] = {}
        for eqn in jaxpr.eqns:
            for v in eqn.outvars:
                self.producer[v] = eqn
        position = {eqn.outvars[0]: i for i, eqn in enumerate(jaxpr.eqns) if len(eqn.outvars) == 1}

        def choose() -> list[tuple[int, int, int]]:
            return [(position[v], g, a) for v, (_, g, a) in self._find_repeats(jaxpr).items()]

        # decided at the task's own shapes and replayed at the others (`decide`), so every configuration
        # rewrites the same equations (at a validation shape the group may be 1, where a repeat is no longer
        # visible in the sizes)
        picked = decide(choose) if decide is not None else choose()
        self.repeats = {}
        for pos, gdim, axis in picked:
            eqn = jaxpr.eqns[pos] if pos < len(jaxpr.eqns) else None
            if eqn is None or eqn.primitive.name != "reshape":
                self.repeats = {}
                break
            self.repeats[eqn.outvars[0]] = (eqn.invars[0], gdim, axis)
        self.split: dict[Any, Split] = {}
        self.views: dict[tuple[Any, int], tuple[Any, bool]] = {}

    @property
    def active(self) -> bool:
        return bool(self.repeats)

    # --- finding the repeat ---------------------------------------------------------------------------
    def _find_repeats(self, jaxpr: Any) -> dict[Any, tuple[Any, int, int]]:
        """Merging reshapes of a broadcast head axis: result var -> (source var, its G dim, the merged dim),
        kept only where some repeat reaches a dot (through transposes and casts)."""
        bdims: dict[Any, set[int]] = {}  # dims of a value that are a pure broadcast (every slice equal)
        found: dict[Any, tuple[Any, int, int]] = {}
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if not eqn.invars or isinstance(eqn.invars[0], jcore.Literal):
                continue
            x, out = eqn.invars[0], eqn.outvars[0]
            xs, os_ = _shape(x), _shape(out)
            if name == "broadcast_in_dim":
                dims = tuple(int(d) for d in eqn.params["broadcast_dimensions"])
                b = {d for d in range(len(os_)) if d not in dims and os_[d] > 1}
                b |= {dims[i] for i in bdims.get(x, set())}
                b |= {dims[i] for i in range(len(xs)) if xs[i] == 1 and os_[dims[i]] > 1}
                if b:
                    bdims[out] = b
            elif name == "reshape" and x in bdims:
                m = _unit_only(xs, os_)
                if m is not None:
                    bdims[out] = {m[d] for d in bdims[x] if d in m}
                    continue
                for p in _merges(xs, os_):
                    if p + 1 in bdims[x] and p not in bdims[x]:
                        found[out] = (x, p + 1, p)
                        break
        reach = set(found)
        used = False
        for eqn in jaxpr.eqns:
            hit = any(not isinstance(v, jcore.Literal) and v in reach for v in eqn.invars)
            if not hit:
                continue
            if eqn.primitive.name == "dot_general":
                used = True
            elif eqn.primitive.name in PASS_THROUGH:
                reach.update(eqn.outvars)
        return found if used else {}

    def _unit(self, var: Any, gdim: int) -> Any:
        """`var` recomputed from its broadcast chain with dim `gdim` (a broadcast dim) kept at size 1."""
        eqn = self.producer[var]
        shape = list(_shape(var))
        shape[gdim] = 1
        x = eqn.invars[0]
        if eqn.primitive.name == "broadcast_in_dim":
            dims = tuple(int(d) for d in eqn.params["broadcast_dimensions"])
            src = self.read(x)
            inner = self.producer.get(x)
            if gdim in dims and inner is not None and inner.primitive.name in ("broadcast_in_dim", "reshape"):
                src = self._unit(x, dims.index(gdim))  # carried from a broadcast dim of the operand
            return lax.broadcast_in_dim_p.bind(
                src, shape=tuple(shape), broadcast_dimensions=dims, sharding=None
            )
        back = {b: a for a, b in (_unit_only(_shape(x), _shape(var)) or {}).items()}
        return lax.reshape_p.bind(
            self._unit(x, back[gdim]), new_sizes=tuple(shape), dimensions=None, sharding=None
        )

    # --- the rewrite ----------------------------------------------------------------------------------
    def apply(self, eqn: Any) -> list[Any] | None:
        """The equation's results (merged values for `env`) when the rewrite takes it, else None."""
        out = eqn.outvars[0] if len(eqn.outvars) == 1 else None
        if out is None:
            return None
        if out in self.repeats:
            x, gdim, axis = self.repeats[out]
            xs = _shape(x)
            try:
                source = self._unit(x, gdim)
            except KeyError:  # the broadcast chain does not pair up at these sizes: left as it is
                return None
            self.split[out] = Split(source, axis, xs[axis], xs[gdim], unit=True)
            return None  # the merged value is the reference's own reshape
        if not any(not isinstance(v, jcore.Literal) and v in self.split for v in eqn.invars):
            return None
        try:
            s = self._rule(eqn)
        except _Refused:
            return None
        self.split[out] = s
        return [self.merged(out)]

    def merged(self, var: Any) -> Any:
        s = self.split[var]
        val = s.value
        if s.unit:
            full = s.shape(_shape(var), unit=False)
            val = lax.broadcast_in_dim(val, full, tuple(range(len(full))))
        return lax.reshape(val, _shape(var))

    def _rule(self, eqn: Any) -> Split:
        name = eqn.primitive.name
        if name == "transpose":
            return self._transpose(eqn)
        if name == "stop_gradient":
            return self.split[eqn.invars[0]]
        if name == "broadcast_in_dim":
            return self._broadcast(eqn)
        if name in REDUCTIONS:
            return self._reduce(eqn)
        if name == "dot_general":
            return self._dot(eqn)
        if name in MAPS:
            return self._map(eqn)
        raise _Refused(name)

    def _transpose(self, eqn: Any) -> Split:
        s = self.split[eqn.invars[0]]
        perm = [int(p) for p in eqn.params["permutation"]]
        new = _split_map(perm, s.axis)
        return Split(lax.transpose(s.value, new), perm.index(s.axis), s.groups, s.size, s.unit)

    def _broadcast(self, eqn: Any) -> Split:
        s = self.split[eqn.invars[0]]
        dims = [int(d) for d in eqn.params["broadcast_dimensions"]]
        o = dims[s.axis]
        shape = Split(None, o, s.groups, s.size, s.unit).shape(_shape(eqn.outvars[0]))
        return Split(_rebroadcast(eqn, s.value, shape, _split_map(dims, o)), o, s.groups, s.size, s.unit)

    def _reduce(self, eqn: Any) -> Split:
        s = self.split[eqn.invars[0]]
        axes = [int(a) for a in eqn.params["axes"]]
        if s.axis in axes:
            raise _Refused("a reduction over the heads")
        params = dict(eqn.params, axes=tuple(_ex(a, s.axis) for a in axes))
        value = eqn.primitive.bind(s.value, **params)
        return Split(value, s.axis - sum(a < s.axis for a in axes), s.groups, s.size, s.unit)

    def _head(self, eqn: Any, *, same_axis: bool = True) -> Split:
        """The split every split operand of `eqn` shares (refused when they disagree; a dot's operands may
        hold the heads at different dims)."""
        splits = [self.split[v] for v in eqn.invars if not isinstance(v, jcore.Literal) and v in self.split]
        first = splits[0]
        for s in splits[1:]:
            if (s.groups, s.size) != (first.groups, first.size) or (same_axis and s.axis != first.axis):
                raise _Refused("operands split differently")
        return first

    def _map(self, eqn: Any) -> Split:
        head = self._head(eqn)
        rank = len(_shape(eqn.outvars[0]))
        vals: list[Any] = []
        units: list[bool] = []
        for v in eqn.invars:
            if isinstance(v, jcore.Literal) or len(_shape(v)) == 0:
                vals.append(self.read(v))
                units.append(True)
                continue
            if len(_shape(v)) != rank:
                raise _Refused("operands of different ranks")
            val, unit = self.view(v, head.axis, head.groups, head.size)
            vals.append(val)
            units.append(unit)
        unit = all(units)
        shaped = [len(_shape(v)) > 0 and not isinstance(v, jcore.Literal) for v in eqn.invars]
        full = head.shape(_shape(eqn.outvars[0]), unit=unit)
        vals = [
            lax.broadcast_in_dim(x, full, tuple(range(rank + 1))) if s and u and not unit else x
            for x, s, u in zip(vals, shaped, units, strict=True)
        ]
        return Split(eqn.primitive.bind(*vals, **eqn.params), head.axis, head.groups, head.size, unit)

    def view(self, var: Any, axis: int, groups: int, size: int) -> tuple[Any, bool]:
        """`var` in split form along `axis` (value, unit): its own split when it has one; else derived
        from its producer where that stays on the trusted layout path (transpose, broadcast, cast), else a
        reshape (a view of the contiguous axis)."""
        s = self.split.get(var)
        if s is not None:
            if (s.axis, s.groups, s.size) != (axis, groups, size):
                raise _Refused("operands split differently")
            return s.value, s.unit
        key = (var, axis)
        if key in self.views:
            return self.views[key]
        shape = Split(None, axis, groups, size, False).shape(_shape(var))
        eqn = self.producer.get(var)
        name = eqn.primitive.name if eqn is not None else None
        got: tuple[Any, bool]
        if name == "transpose":
            perm = [int(p) for p in eqn.params["permutation"]]
            src, unit = self.view(eqn.invars[0], perm[axis], groups, size)
            got = (lax.transpose(src, _split_map(perm, perm[axis])), unit)
        elif name == "broadcast_in_dim":
            x = eqn.invars[0]
            dims = [int(d) for d in eqn.params["broadcast_dimensions"]]
            if axis in dims and _shape(x)[dims.index(axis)] != 1 and not isinstance(x, jcore.Literal):
                src, unit = self.view(x, dims.index(axis), groups, size)
                shape = Split(None, axis, groups, size, unit).shape(_shape(var))
                got = (_rebroadcast(eqn, src, shape, _split_map(dims, axis)), unit)
            else:  # the heads are broadcast: the same for every head
                got = (_rebroadcast(eqn, self.read(x), shape, [_ex(d, axis) for d in dims]), False)
        elif name == "convert_element_type":
            src, unit = self.view(eqn.invars[0], axis, groups, size)
            got = (eqn.primitive.bind(src, **eqn.params), unit)
        elif name == "iota" and int(eqn.params["dimension"]) != axis:  # the same for every head
            params = dict(eqn.params, shape=shape, dimension=_ex(int(eqn.params["dimension"]), axis))
            got = (eqn.primitive.bind(**params), False)
        elif name in MAPS and self._index_only(var):
            # a mask or position built from iotas and scalars (a causal offset per sequence): rebuilt in
            # split form, so the attention kernel computes it per block instead of reading a reshaped copy
            vals: list[Any] = []
            for v in eqn.invars:
                if isinstance(v, jcore.Literal) or len(_shape(v)) == 0:
                    vals.append(self.read(v))
                    continue
                val, unit = self.view(v, axis, groups, size)
                vals.append(lax.broadcast_in_dim(val, shape, tuple(range(len(shape)))) if unit else val)
            got = (eqn.primitive.bind(*vals, **eqn.params), False)
        else:
            got = (lax.reshape(self.read(var), shape), False)
        self.views[key] = got
        return got

    def _index_only(self, var: Any, depth: int = 0) -> bool:
        """`var` is computed by maps from iotas, literals and scalars alone (no array read from memory)."""
        if isinstance(var, jcore.Literal) or len(_shape(var)) == 0:
            return True
        eqn = self.producer.get(var)
        if eqn is None or depth > 32 or var in self.split:
            return False
        name = eqn.primitive.name
        if name == "iota":
            return True
        if name == "broadcast_in_dim":
            return len(_shape(eqn.invars[0])) == 0 or self._index_only(eqn.invars[0], depth + 1)
        if name in MAPS:
            return all(self._index_only(v, depth + 1) for v in eqn.invars)
        return False

    def _dot(self, eqn: Any) -> Split:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = eqn.invars
        contract = [[int(d) for d in lc], [int(d) for d in rc]]
        batch = [[int(d) for d in lb], [int(d) for d in rb]]
        pos = None
        for side, v in enumerate((lhs, rhs)):
            s = self.split.get(v) if not isinstance(v, jcore.Literal) else None
            if s is None:
                continue
            if s.axis not in batch[side]:
                raise _Refused("the heads are not a batch dim of the dot")
            p = batch[side].index(s.axis)
            if pos is not None and p != pos:
                raise _Refused("the heads pair with another dim")
            pos = p
        assert pos is not None
        head = self._head(eqn, same_axis=False)
        axes = [batch[0][pos], batch[1][pos]]
        vals, units = [], []
        for side, v in enumerate((lhs, rhs)):
            val, unit = self.view(v, axes[side], head.groups, head.size)
            if unit:
                val = lax.squeeze(val, (axes[side] + 1,))
            vals.append(val)
            units.append(unit)
        nb = len(batch[0])
        if all(units):  # both the same for every query head of a group: one product per K/V head
            out = lax.dot_general(vals[0], vals[1], ((lc, rc), (lb, rb)), **self._dot_params(eqn))
            return Split(lax.expand_dims(out, (pos + 1,)), pos, head.groups, head.size, True)
        new_c, new_b, free = [], [], []
        for side in (0, 1):
            a = axes[side]
            m = (lambda d: d) if units[side] else (lambda d, a=a: _ex(d, a))
            new_c.append(tuple(m(d) for d in contract[side]))
            b = [m(d) for d in batch[side]]
            if not any(units):
                b.insert(pos + 1, a + 1)
            new_b.append(tuple(b))
            rank = len(_shape((lhs, rhs)[side])) + (0 if units[side] else 1)
            free.append([d for d in range(rank) if d not in new_c[side] and d not in b])
        out = lax.dot_general(vals[0], vals[1], (tuple(new_c), tuple(new_b)), **self._dot_params(eqn))
        if not any(units):
            return Split(out, pos, head.groups, head.size, False)
        side = units.index(False)  # the query side: its G dim is now a free dim of the product
        g_at = nb + (len(free[0]) if side == 1 else 0) + free[side].index(axes[side] + 1)
        order = [d for d in range(out.ndim) if d != g_at]
        order.insert(pos + 1, g_at)
        if order != list(range(out.ndim)):
            out = lax.transpose(out, tuple(order))
        return Split(out, pos, head.groups, head.size, False)

    @staticmethod
    def _dot_params(eqn: Any) -> dict[str, Any]:
        return {
            k: eqn.params[k] for k in ("precision", "preferred_element_type") if eqn.params.get(k) is not None
        }
