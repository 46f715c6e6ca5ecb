"""Online (rescaled) reductions: `sum(exp(a - max(a)))` walked in blocks without a second pass.

A log-sum-exp or a cross-entropy over a long axis reduces twice: first the row max `m`, then
`sum(exp(a - m))`, which needs the *final* `m`. Done naively over an axis that is split across grid steps
this means two passes over HBM (or, after a matmul, writing the `[M, N]` logits out and reading them back).
The online form keeps a running max and a running sum and rescales the sum whenever the max grows:

    m_new = max(m_run, max(a_blk))
    s_run = s_run * exp(m_run - m_new) + sum(exp(a_blk - m_new))
    m_run = m_new

After the last block `m_run` is the row max and `s_run` equals `sum(exp(a - m_run))` exactly (up to
rounding), so every value computed from them afterwards (`log(s) + m`, `lse - picked`) is unchanged.

`jax.nn.logsumexp` shifts by a *finite* max instead, `s = where(isfinite(m), m, 0)` (and `max(m, -inf)`
first, an identity): the same rescaling holds with `exp(s_run - s_new)`, and a row whose running max is
still -inf has accumulated nothing, so its rescale factor is 0.

This module only *recognises* the pattern in the jaxpr (a `reduce_sum` whose operand is `exp(a - b)`, where
`b` is a `reduce_max` result seen through layout ops, or that finite shift of it, and `a` does not depend on
any reduction); the partitioner uses it to keep such regions in one streamed kernel and the kernel builders
use it to emit the rescaled accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from maxkernel.authors.offline.dataflow import Graph, is_literal, reduced_axes

SEE_THROUGH = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "convert_element_type"})
"""Layout ops between the row max and the `sub` that do not change its values."""


def _through_layout(g: Graph, var: Any, own: set[int]) -> Any:
    """The var behind a chain of value-preserving layout ops inside `own` (or `var` itself)."""
    while True:
        p = g.producer.get(var)
        if p is None or p not in own or g.eqns[p].primitive.name not in SEE_THROUGH:
            return var
        if g.kind[p] not in ("absorbed",):
            return var
        var = g.eqns[p].invars[0]


def _only_consumer(g: Graph, var: Any, eqn: int) -> bool:
    return var not in g.out_set and all(c == eqn for c in g.consumers.get(var, []))


@dataclass(frozen=True)
class OnlineSum:
    """One rescalable `sum(exp(a - b))`: `max_eqn` produces the row max behind `b`; `values` are the
    per-block equations from the `sub` to the sum's operand (sub, exp, casts); `layout` the layout ops that
    carry the max to the `sub` (broadcasts, unit reshapes)."""

    max_eqn: int
    values: tuple[int, ...]
    layout: tuple[int, ...]
    finite_shift: bool = False  # b is where(isfinite(max), max, 0) (jax.nn.logsumexp), not the max itself


def online_sum(g: Graph, s: int, own: set[int]) -> OnlineSum | None:
    """`s` as an `OnlineSum` when it is a `reduce_sum` of the form `sum(exp(a - b))` with `b` a
    `reduce_max` result along as many axes; None when it is not of that form, or when an intermediate of
    the chain is used elsewhere (then the un-rescaled value would be observable)."""
    e = g.eqns[s]
    if e.primitive.name != "reduce_sum":
        return None
    chain: list[int] = []
    x = e.invars[0]
    consumer = s
    # optional casts around exp (a bf16 reference upcasts before the sum)
    while True:
        p = g.producer.get(x)
        if p is None or p not in own or not _only_consumer(g, x, consumer):
            return None
        name = g.eqns[p].primitive.name
        if name == "convert_element_type":
            chain.append(p)
            consumer, x = p, g.eqns[p].invars[0]
            continue
        if name != "exp":
            return None
        chain.append(p)
        consumer, x = p, g.eqns[p].invars[0]
        break
    p = g.producer.get(x)
    if p is None or p not in own or not _only_consumer(g, x, consumer) or g.eqns[p].primitive.name != "sub":
        return None
    chain.append(p)
    a, b = g.eqns[p].invars
    if is_literal(a) or is_literal(b):
        return None
    layout: list[int] = []
    m = _through_layout(g, b, own)
    v = b
    while v is not m:
        q = g.producer[v]
        layout.append(q)
        v = g.eqns[q].invars[0]
    finite = _finite_shift(g, m, own)
    if finite is not None:
        m, extra = finite
        layout.extend(extra)
    else:  # `max(m, -inf)` (jax.nn.log_softmax's shift): an identity
        m, extra = _past_neg_inf_max(g, m, own)
        layout.extend(extra)
    j = g.producer.get(m)
    if j is None or j not in own or g.eqns[j].primitive.name != "reduce_max":
        return None
    if len(reduced_axes(g.eqns[j])) != len(reduced_axes(e)):
        return None
    return OnlineSum(
        max_eqn=j,
        values=tuple(sorted(chain)),
        layout=tuple(sorted(layout)),
        finite_shift=finite is not None,
    )


def _is_literal_value(g: Graph, var: Any, own: set[int], value: float) -> bool:
    """`var` is the scalar literal `value`, or a broadcast of it inside `own`."""
    if is_literal(var):
        return bool(np.all(np.asarray(var.val) == value))
    p = g.producer.get(var)
    if p is None or g.eqns[p].primitive.name != "broadcast_in_dim":
        return False
    return is_literal(g.eqns[p].invars[0]) and bool(np.all(np.asarray(g.eqns[p].invars[0].val) == value))


def _finite_shift(g: Graph, var: Any, own: set[int]) -> tuple[Any, list[int]] | None:
    """`var = select_n(isfinite(x), 0, x)` with `x = max(m, -inf)` or `m` itself (jax.nn.logsumexp's shift):
    (m, the equations between them); None when `var` is not of that form."""
    p = g.producer.get(var)
    if p is None or p not in own or g.eqns[p].primitive.name != "select_n" or len(g.eqns[p].invars) != 3:
        return None
    pred, on_false, x = g.eqns[p].invars
    if is_literal(pred) or is_literal(x) or not _is_literal_value(g, on_false, own, 0.0):
        return None
    q = g.producer.get(pred)
    if q is None or q not in own or g.eqns[q].primitive.name != "is_finite" or g.eqns[q].invars[0] is not x:
        return None
    x, extra = _past_neg_inf_max(g, x, own)
    return x, [p, q, *extra]


def _past_neg_inf_max(g: Graph, x: Any, own: set[int]) -> tuple[Any, list[int]]:
    """`x = max(m, -inf)` (an identity): (m, [that equation]); (x, []) when `x` is anything else."""
    r = g.producer.get(x)
    if r is not None and r in own and g.eqns[r].primitive.name == "max":
        a, c = g.eqns[r].invars
        if _is_literal_value(g, c, own, -np.inf) and not is_literal(a):
            return a, [r]
        if _is_literal_value(g, a, own, -np.inf) and not is_literal(c):
            return c, [r]
    return x, []


def online_sums(g: Graph, eqns: list[int]) -> dict[int, OnlineSum]:
    """Every online-rescalable `reduce_sum` among `eqns`, by its equation index."""
    own = set(eqns)
    out: dict[int, OnlineSum] = {}
    for i in eqns:
        if g.kind[i] == "reduce":
            found = online_sum(g, i, own)
            if found is not None:
                out[i] = found
    return out
