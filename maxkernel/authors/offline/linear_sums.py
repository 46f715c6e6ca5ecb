"""Weighted sums of shifted values, split so the shift's reduction no longer has to finish first.

A cross-entropy written with `log_softmax` reduces the logits three times along the vocabulary axis:

    m = max(x);  lse = log(sum(exp(x - m)));  loss = -sum(w * ((x - m) - lse))      (w: the one-hot labels)

The last sum needs `m` and `lse`, the results of the first two reductions, inside its operand, so a kernel
walking the axis in blocks cannot compute it in the same pass: the logits (`[tokens, vocab]` after a matmul,
4 GB of bf16 for Llama's vocabulary) go to HBM and are read back, and the shared `x - m` keeps the
log-sum-exp from being accumulated online (online.py). With `c` constant along the reduced axes,

    sum(w * (a - c)) = sum(w * a) - c * sum(w)

(exact algebra; applied through every such shift, and through the widening casts between them and around
the product, which is then formed in the sum's dtype), so every
reduction reads only the logits and the weights: one streamed pass, in the matmul's epilogue when the
logits come from one. In floating point the right-hand side rounds differently: the shifted values are no
longer rounded to the reference's (possibly bf16) dtype before the weighted sum, which is the more exact of
the two; the harness checks the result against the reference at the task's tolerance.

Only applied where `w` does not itself depend on the shifted value (`sum((a - c) * (a - c))` is a variance:
moments.py) and the product is used by the sum alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax.extend import core as jcore

from maxkernel.tools.jaxpr import use_counts


def _is_lit(v: Any) -> bool:
    return isinstance(v, jcore.Literal)


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in v.aval.shape)


def _widening(e: Any) -> bool:
    """A float cast to a float at least as wide (bf16 -> f32): exact, so it distributes over the shift."""
    if e.primitive.name != "convert_element_type":
        return False
    src, dst = np.dtype(e.invars[0].aval.dtype), np.dtype(e.outvars[0].aval.dtype)
    return _floating(src) and _floating(dst) and dst.itemsize >= src.itemsize


def _floating(dtype: Any) -> bool:
    import jax.numpy as jnp

    return bool(jnp.issubdtype(dtype, jnp.floating))


@dataclass(frozen=True)
class _Shifted:
    """`sum(w * cast(a - c_1 - ... - c_k), axes)`: the weights, the unshifted value, the shifts (each
    constant along `axes`) and the reduction's result dtype."""

    w: Any
    a: Any
    shifts: tuple[Any, ...]
    axes: tuple[int, ...]
    dtype: Any


def _constant_along(c: Any, full: tuple[int, ...], axes: tuple[int, ...], producer: dict[Any, Any]) -> bool:
    """Is `c` the same at every position along `axes` (a size-1 dim there, or a broadcast from a value that
    has none)?"""
    if _is_lit(c):
        return True
    shape = _shape(c)
    if len(shape) == len(full) and all(shape[a] == 1 for a in axes):
        return True
    e = producer.get(c)
    if e is None or e.primitive.name != "broadcast_in_dim" or _shape(e.outvars[0]) != full:
        return False
    dims = [int(d) for d in e.params["broadcast_dimensions"]]
    src = _shape(e.invars[0])
    return all(src[k] == 1 for k, d in enumerate(dims) if d in axes)


def _depends_on(v: Any, target: Any, producer: dict[Any, Any]) -> bool:
    seen: set[Any] = set()
    stack = [v]
    while stack:
        u = stack.pop()
        if _is_lit(u) or u in seen:
            continue
        if u is target:
            return True
        seen.add(u)
        e = producer.get(u)
        if e is not None:
            stack.extend(e.invars)
    return False


def _match(eqn: Any, producer: dict[Any, Any], uses: dict[Any, int]) -> _Shifted | None:
    if eqn.primitive.name != "reduce_sum" or len(eqn.outvars) != 1:
        return None
    axes = tuple(sorted(int(a) for a in eqn.params["axes"]))
    prod_var = eqn.invars[0]
    mul = producer.get(prod_var)
    while mul is not None and _widening(mul) and uses.get(prod_var) == 1:  # a bf16 product summed in f32
        prod_var = mul.invars[0]
        mul = producer.get(prod_var)
    if mul is None or mul.primitive.name != "mul" or uses.get(prod_var) != 1:
        return None
    full = _shape(prod_var)
    if not _floating(prod_var.aval.dtype):
        return None
    for k in (0, 1):
        t, w = mul.invars[k], mul.invars[1 - k]
        if _is_lit(t) or _is_lit(w) or _shape(w) != full:
            continue
        shifts: list[Any] = []
        v = t
        while True:
            e = producer.get(v)
            if e is None:
                break
            if _widening(e):
                v = e.invars[0]
                continue
            if e.primitive.name != "sub" or _is_lit(e.invars[0]) or _shape(e.invars[0]) != full:
                break
            if not _constant_along(e.invars[1], full, axes, producer):
                break
            shifts.append(e.invars[1])
            v = e.invars[0]
        if shifts and not _depends_on(w, t, producer):
            return _Shifted(w=w, a=v, shifts=tuple(shifts), axes=axes, dtype=eqn.outvars[0].aval.dtype)
    return None


def _along(c: Any, full: tuple[int, ...], axes: tuple[int, ...]) -> Any:
    """The shift `c` (constant along `axes`) as a value of the reduction's result shape."""
    import jax.numpy as jnp
    from jax import lax

    out = tuple(n for d, n in enumerate(full) if d not in axes)
    c = jnp.asarray(c)
    if c.ndim == 0:
        return jnp.broadcast_to(c, out)
    if c.ndim == len(full) and all(c.shape[a] == 1 for a in axes):
        kept = tuple(c.shape[d] for d in range(len(full)) if d not in axes)
        c = jnp.reshape(c, kept)
        return jnp.broadcast_to(c, out) if kept != out else c
    # the full-shape broadcast of a smaller value: pick index 0 along the reduced axes
    c = lax.slice(c, [0] * len(full), [1 if d in axes else n for d, n in enumerate(full)])
    return jnp.reshape(c, out)


class ShiftedSums:
    """Finds `sum(w * (a - c))` with `c` constant along the reduced axes in one jaxpr and evaluates it as
    `sum(w * a) - c * sum(w)` (see the module docstring)."""

    def __init__(self, jaxpr: Any) -> None:
        uses = use_counts(jaxpr)
        producer = {v: e for e in jaxpr.eqns for v in e.outvars}
        self.rewrites: dict[Any, _Shifted] = {}
        for eqn in jaxpr.eqns:
            found = _match(eqn, producer, uses)
            if found is not None:
                self.rewrites[eqn.outvars[0]] = found

    def apply(self, eqn: Any, read: Callable[[Any], Any]) -> Any | None:
        """The equation's result in its split form, or None to evaluate it as usual."""
        if len(eqn.outvars) != 1 or eqn.outvars[0] not in self.rewrites:
            return None
        import jax.numpy as jnp

        p = self.rewrites[eqn.outvars[0]]
        full = tuple(int(d) for d in eqn.invars[0].aval.shape)
        dtype = jnp.dtype(p.dtype)
        w = read(p.w).astype(dtype)
        total = jnp.sum(w * read(p.a).astype(dtype), axis=p.axes)
        weight = jnp.sum(w, axis=p.axes)
        for c in p.shifts:
            total = total - _along(read(c), full, p.axes).astype(dtype) * weight
        return total.astype(dtype)
