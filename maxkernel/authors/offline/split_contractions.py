"""A dot whose contraction runs over concatenated pieces, as a sum of one dot per piece.

Multi-head latent attention builds each query and key head from two parts, a content part and a rotary
part, and concatenates them along the head dim before the score dot:

    q = concat([q_nope, rope(q_pe)], -1);  k = concat([k_nope, rope(k_pe)], -1);  s = q @ k.T

The concatenation is a copy of both operands in HBM (two [B, S, H, 192] arrays at DeepSeek-V3's sizes) and
keeps the attention kernel from reading the parts where they are. With the contraction split at the
pieces' boundaries,

    concat([a1, a2]) @ concat([b1, b2]).T = a1 @ b1.T + a2 @ b2.T

(exact algebra), each dot reads its pieces directly and the attention builder takes the summed score dots
as one score (`attention._score_branch`). Both sides must be cut at the same places. A nested
concatenation (the rotary part is itself two rotated halves) stays one piece: split further, the halves'
common input would be read by two dots along two contraction axes, which a kernel cannot read in one
layout. Each piece's dot accumulates in float32 and the sum is rounded once to the dot's own result type,
as the single dot rounds its one accumulator: the result differs from the reference only in the order of
the float32 additions.

Only applied where the concatenations feed nothing but this dot (through transposes), and to contractions
no deeper than an attention head (`attention.MAX_HEAD_DIM`): a deep matmul with concatenated weights stays
one matmul for the matmul kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax.extend import core as jcore

from maxkernel.tools.jaxpr import use_counts

MAX_DEPTH = 768
"""Deepest contraction split (an attention head dim; `attention.MAX_HEAD_DIM`)."""


@dataclass(frozen=True)
class _Side:
    """One operand of the dot: `transpose(...(concatenate(parts, dim)))`; `perms` from the concatenation
    outwards; `dim` the operand dim the concatenated dim becomes."""

    parts: tuple[Any, ...]
    sizes: tuple[int, ...]
    perms: tuple[tuple[int, ...], ...]
    dim: int


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in v.aval.shape)


def _side(v: Any, producer: dict[Any, Any], uses: dict[Any, int]) -> _Side | None:
    perms: list[tuple[int, ...]] = []
    while True:
        if isinstance(v, jcore.Literal) or uses.get(v) != 1:
            return None
        e = producer.get(v)
        if e is None:
            return None
        if e.primitive.name == "transpose":
            perms.append(tuple(int(a) for a in e.params["permutation"]))
            v = e.invars[0]
            continue
        if e.primitive.name != "concatenate":
            return None
        axis = int(e.params["dimension"])
        parts = list(e.invars)
        if len(parts) < 2 or any(isinstance(u, jcore.Literal) for u in parts):
            return None
        dim = axis
        for perm in reversed(perms):  # the outermost transpose last: where does `axis` end up
            dim = perm.index(dim)
        perms.reverse()  # from the concatenation outwards
        return _Side(tuple(parts), tuple(_shape(p)[axis] for p in parts), tuple(perms), dim)


class SplitContractions:
    """Finds dots over concatenated operands (module docstring) and evaluates them piece by piece."""

    def __init__(self, jaxpr: Any) -> None:
        uses = use_counts(jaxpr)
        producer = {v: e for e in jaxpr.eqns for v in e.outvars}
        self.plans: dict[Any, tuple[_Side, _Side]] = {}
        for eqn in jaxpr.eqns:
            if eqn.primitive.name != "dot_general":
                continue
            sides = [_side(v, producer, uses) for v in eqn.invars[:2]]
            if sides[0] is None or sides[1] is None:
                continue
            (lc, rc), _ = eqn.params["dimension_numbers"]
            lc, rc = [int(d) for d in lc], [int(d) for d in rc]
            if sides[0].dim not in lc or rc[lc.index(sides[0].dim)] != sides[1].dim:
                continue
            depth = int(np.prod([_shape(eqn.invars[0])[d] for d in lc]))
            if depth > MAX_DEPTH:
                continue
            if sides[0].sizes != sides[1].sizes:
                continue
            self.plans[eqn.outvars[0]] = (sides[0], sides[1])

    def apply(self, eqn: Any, read: Callable[[Any], Any]) -> Any | None:
        if len(eqn.outvars) != 1 or eqn.outvars[0] not in self.plans:
            return None
        import jax.numpy as jnp
        from jax import lax

        lhs, rhs = self.plans[eqn.outvars[0]]
        out_dtype = eqn.outvars[0].aval.dtype
        floating = bool(jnp.issubdtype(out_dtype, jnp.floating))
        acc_dtype = jnp.float32 if floating and np.dtype(out_dtype).itemsize <= 4 else out_dtype
        params = dict(eqn.params)
        params["preferred_element_type"] = acc_dtype
        total = None
        for a, b in zip(lhs.parts, rhs.parts, strict=True):
            pieces = [_laid_out(side, read(v)) for side, v in ((lhs, a), (rhs, b))]
            part = lax.dot_general_p.bind(*pieces, **params)
            total = part if total is None else total + part
        return total.astype(out_dtype)


def _laid_out(side: _Side, x: Any) -> Any:
    """A piece laid out as the dot's operand: the transposes between the concatenation and the dot."""
    from jax import lax

    for perm in side.perms:
        x = lax.transpose(x, perm)
    return x
