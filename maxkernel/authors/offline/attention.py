"""Recognise attention in the flat jaxpr: scores = q·kᵀ (one or more dots summed), elementwise work on the
scores (scale, masks built from iotas or inputs, biases), a softmax along the key axis, then probs·v.

The softmax is recognised by its data flow, not by names: a row max `m` of the logits `G`, `exp(G - f(m))`
where `f` only stabilises `m`, a row sum `l` of that, and either `p = e / l` fed to the second dot or the
division applied after it. Without a row max and row sum (retention, linear attention), the scores'
elementwise function goes straight into the second dot, and the kernel accumulates without rescaling.

What the match records is enough for a flash-attention kernel: which equations run once per key block (the
score function), which values the online softmax replaces (`m`, `l`, `e`, `p`), and whether the result
still needs dividing by `l`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from maxkernel.authors.offline.axes import Axes, Conflict
from maxkernel.authors.offline.dataflow import is_literal, reduced_axes
from maxkernel.authors.offline.emit import dtype_name
from maxkernel.authors.offline.partition import AttentionInfo, Partition

MAX_HEAD_DIM = 768
"""Score dots contract over a head dim; deeper contractions (hidden sizes) are matmul chains."""


def _free_dims(e: Any, side: int) -> list[int]:
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    contract, batch = (lc, lb) if side == 0 else (rc, rb)
    return [d for d in range(len(e.invars[side].aval.shape)) if d not in contract and d not in batch]


def match_attention(part: Partition, d1: int) -> AttentionInfo | None:
    """The attention rooted at score dot `d1`, or None. The key side is the operand with one non-unit free
    dim; when both have one (a decode query's only free dim is its group of heads sharing a K/V head),
    each is tried: the softmax's reductions tell them apart."""
    g = part.g
    e1 = g.eqns[d1]
    for k_side in (1, 0):
        k_free = [d for d in _free_dims(e1, k_side) if not g.unit(e1.invars[k_side], d)]
        if len(k_free) == 1:
            info = _match_with_keys(part, d1, k_side, k_free[0])
            if info is not None:
                return info
    return None


def _match_with_keys(part: Partition, d1: int, k_side: int, k_dim: int) -> AttentionInfo | None:
    g = part.g
    e1 = g.eqns[d1]
    k_free = [k_dim]
    (lc, rc), _ = e1.params["dimension_numbers"]
    depth = max(max(s[d] for d in lc) for s in [*g.traces.shapes(e1.invars[0])][:1]) if lc else 1
    for sh in g.traces.shapes(e1.invars[0]):
        depth = max(depth, int(np.prod([sh[d] for d in lc])) if lc else 1)
    if depth > MAX_HEAD_DIM:
        return None  # a contraction this deep is a matmul chain (an MLP), not attention
    ax = Axes(g)
    try:
        ax.add(e1)
    except Conflict:
        return None
    kv = ax.cls(e1.invars[k_side], k_free[0])
    chain: list[int] = [d1]
    chain_vars: set[Any] = set(e1.outvars)
    steals: list[int] = []  # earlier map regions whose only result is a term of the scores
    score_dots = [d1]
    reduces: list[int] = []
    pv: int | None = None
    for j in range(d1 + 1, len(g.eqns)):
        if part.status[j] != "owned" or j in part.owner:
            continue
        e = g.eqns[j]
        ins = [v for v in e.invars if not is_literal(v)]
        if not any(v in chain_vars for v in ins):
            continue
        kind = g.kind[j]
        extra: list[int] = []
        if kind == "dot":
            pv = j
        elif kind == "reduce":
            red = {ax.cls(e.invars[0], a) for a in reduced_axes(e)} - {None}
            if red != {ax.find(kv)} or e.primitive.name not in ("reduce_max", "reduce_sum"):
                return None
            reduces.append(j)
        elif kind in ("elementwise", "absorbed"):
            for v in ins:
                if v in chain_vars:
                    continue
                branch = _score_branch(part, v, chain, j, steals)
                if branch is None:
                    return None
                extra.extend(branch)
        else:
            return None
        try:
            for k in extra:
                ax.add(g.eqns[k])
                if g.kind[k] == "dot":
                    score_dots.append(k)
            ax.add(e)
        except Conflict:
            return None
        chain.extend(extra)
        chain.append(j)
        for k in [*extra, j]:
            chain_vars.update(g.eqns[k].outvars)
        if pv is not None:
            break
    if pv is None:
        return None
    ep = g.eqns[pv]
    probs = None
    for side in (0, 1):
        if ep.invars[side] in chain_vars:
            if probs is not None:
                return None
            probs = (side, ep.invars[side])
    if probs is None:
        return None
    (lc, rc), (lb, rb) = ep.params["dimension_numbers"]
    contract = lc if probs[0] == 0 else rc
    if {ax.cls(ep.invars[probs[0]], d) for d in contract} - {None} != {ax.find(kv)}:
        return None
    # every intermediate stays inside the kernel
    chain_set = set(chain)
    for k in chain:
        if k == pv:
            continue
        for v in g.eqns[k].outvars:
            if v in g.out_set:
                return None
            for c in g.consumers.get(v, []):
                if c not in chain_set and not _softmax_tail(part, c, reduces):
                    return None
    info = AttentionInfo(score_dots=score_dots, pv_dot=pv, softmax=bool(reduces), kv_class=kv)
    info.probs = probs[1]
    if reduces and not (
        _check_softmax(part, info, chain, reduces) or _check_row_norm(part, info, chain, reduces)
    ):
        return None
    if not reduces:
        info.logits = probs[1]
    # pull the floats everything needs (masks, casts of q/k/v), then claim the equations
    pulls: list[int] = []
    for k in chain:
        for v in g.eqns[k].invars:
            for p in part.float_closure(v):
                if p not in pulls:
                    pulls.append(p)
    try:
        ax2 = Axes(g)
        for k in sorted(set(pulls) | chain_set):
            ax2.add(g.eqns[k])
    except Conflict:
        return None
    for rid in steals:  # their equations run in this kernel now
        for k in part.regions[rid].owned:
            del part.owner[k]
        del part.regions[rid]
    region = part.new_region("attention")
    region.axes = ax2
    region.owned = sorted(chain_set)
    region.pulled = set(pulls)
    region.dots = [*score_dots, pv]
    region.attention = info
    info.kv_class = ax2.cls(e1.invars[k_side], k_free[0])
    info.probs_side = probs[0]
    for k in chain:
        part.owner[k] = region.id
    return info


def _softmax_tail(part: Partition, c: int, reduces: list[int]) -> bool:
    """A consumer outside the chain that only reshapes the row sum / row max (it may come after the pv dot:
    `dot(e, v) / l`). Those join the region as its epilogue."""
    return part.g.kind[c] in ("absorbed", "elementwise") and c > min(reduces, default=10**9)


def _stealable(part: Partition, rid: int, reader: int) -> list[int] | None:
    """The equations of an earlier map region whose results only the scores' equation `reader` reads (a
    decay mask `exp(where(causal, c_i - c_j, -inf))` built from a cumulative sum): the attention kernel
    computes them per block instead of reading a [.., S, S] array the map kernel wrote to HBM."""
    g = part.g
    r = part.regions[rid]
    if r.kind != "map" or r.dots or r.has_reduction or r.stream or r.attention is not None:
        return None
    owned = set(r.owned)
    if any(g.kind[k] not in ("elementwise", "absorbed") for k in owned):
        return None
    for k in owned:
        for w in g.eqns[k].outvars:
            if w in g.out_set:
                return None
            if any(c not in owned and c != reader for c in g.consumers.get(w, [])):
                return None
    return sorted(owned)


def _score_branch(
    part: Partition, v: Any, chain: list[int], reader: int, steals: list[int]
) -> list[int] | None:
    """A value combined with the scores: a float or glue value (mask, bias), the work of an earlier map
    region that only feeds it (`_stealable`), or another score dot reached through layout-only ops
    (q_rope·k_ropeᵀ added to q_nope·k_nopeᵀ)."""
    g = part.g
    p = g.producer.get(v)
    if p is None or part.status[p] in ("glue", "float"):
        return []
    if p in part.owner:
        stolen = _stealable(part, part.owner[p], reader)
        if stolen is None:
            return []  # written by an earlier kernel: an input
        steals.append(part.owner[p])
        return stolen
    out: list[int] = []
    while True:
        if p in part.owner or part.status[p] != "owned":
            return None
        e = g.eqns[p]
        out.append(p)
        if g.kind[p] == "dot":
            for w in e.invars:
                q = g.producer.get(w)
                if q is not None and part.status[q] == "owned":
                    if q not in part.owner:
                        return None  # its operands need compute that is not done yet
            rf = [d for d in _free_dims(e, 1) if not g.unit(e.invars[1], d)]
            lf = [d for d in _free_dims(e, 0) if not g.unit(e.invars[0], d)]
            if len(rf) != 1 and len(lf) != 1:
                return None
            return sorted(out)
        if g.kind[p] != "absorbed":
            return None
        if len(g.consumers.get(e.outvars[0], [])) != 1:
            return None
        nxt = [w for w in e.invars if not is_literal(w)]
        if len(nxt) != 1:
            return None
        p = g.producer.get(nxt[0])
        if p is None:
            return None


def _derived_only_from(part: Partition, var: Any, source: Any, within: set[int]) -> bool:
    """`var` is computed from `source` alone (plus literals) by elementwise/layout equations in `within`."""
    g = part.g
    stack = [var]
    seen: set[Any] = set()
    while stack:
        v = stack.pop()
        if v is source or is_literal(v) or v in seen:
            continue
        seen.add(v)
        p = g.producer.get(v)
        if p is None or p not in within or g.kind[p] not in ("elementwise", "absorbed"):
            return False
        stack.extend(g.eqns[p].invars)
    return True


def _strip_casts(part: Partition, v: Any, within: set[int]) -> Any:
    g = part.g
    while True:
        p = g.producer.get(v)
        if p is None or p not in within:
            return v
        e = g.eqns[p]
        if e.primitive.name in ("convert_element_type", "copy", "copy_p"):
            v = e.invars[0]
            continue
        return v


def _depends_on(part: Partition, var: Any, source: Any, within: set[int]) -> bool:
    """Is `source` among the values `var` is computed from (through equations in `within`)?"""
    g = part.g
    stack, seen = [var], set()
    while stack:
        v = stack.pop()
        if v is source:
            return True
        if is_literal(v) or v in seen:
            continue
        seen.add(v)
        p = g.producer.get(v)
        if p is not None and p in within:
            stack.extend(g.eqns[p].invars)
    return False


def _check_row_norm(part: Partition, info: AttentionInfo, chain: list[int], reduces: list[int]) -> bool:
    """Retention's normalisation: one float32 row sum `l` of a function of the scores, and the probabilities
    `num / den` with `den` an elementwise function of `l` alone (`maximum(l, 1)`, a guard against tiny sums)
    and `num` independent of `l`. Since `den` is constant along the keys, `(num / den) @ v` is `(num @ v) / den`:
    the kernel accumulates `num @ v` and `l` over the key blocks and divides once (rounding `num` rather than
    `num / den` to the probabilities' dtype: the same relative rounding, as flash attention's unnormalised
    probabilities)."""
    g = part.g
    if len(reduces) != 1 or g.eqns[reduces[0]].primitive.name != "reduce_sum":
        return False
    rsum = g.eqns[reduces[0]]
    l_var = rsum.outvars[0]
    if dtype_name(l_var.aval) != "float32":
        return False
    within = set(chain)
    probs = _strip_casts(part, info.probs, within)
    pd = g.producer.get(probs)
    if pd is None or pd not in within or g.eqns[pd].primitive.name != "div":
        return False
    num, den = g.eqns[pd].invars
    if is_literal(num) or is_literal(den) or dtype_name(probs.aval) != "float32":
        return False
    everywhere = set(range(len(g.eqns)))  # literals' broadcasts are floats, not chain equations
    if not _derived_only_from(part, den, l_var, everywhere) or _depends_on(part, num, l_var, within):
        return False
    # the row sum is read only on the way to the divisor, and the quotient only on the way to the pv dot
    path = [p for p in within if _depends_on(part, den, g.eqns[p].outvars[0], within)]
    path = {p for p in path if _depends_on(part, g.eqns[p].outvars[0], l_var, within)}
    for k in path | {reduces[0]}:
        for c in g.consumers.get(g.eqns[k].outvars[0], []):
            if c not in path and c != pd:
                return False
    v = probs
    while v is not info.probs:
        cs = g.consumers.get(v, [])
        if len(cs) != 1 or g.eqns[cs[0]].primitive.name not in ("convert_element_type", "copy", "copy_p"):
            return False
        v = g.eqns[cs[0]].outvars[0]
    info.softmax, info.row_norm, info.row_sum = False, True, l_var
    info.norm_num, info.norm_den, info.norm_div = num, den, probs
    info.sum_operand = rsum.invars[0]
    return True


def _check_softmax(part: Partition, info: AttentionInfo, chain: list[int], reduces: list[int]) -> bool:
    g = part.g
    names = [g.eqns[r].primitive.name for r in reduces]
    if sorted(names) != ["reduce_max", "reduce_sum"]:
        return False
    rmax = g.eqns[reduces[names.index("reduce_max")]]
    rsum = g.eqns[reduces[names.index("reduce_sum")]]
    logits, m = rmax.invars[0], rmax.outvars[0]
    within = set(chain) | set(range(len(g.eqns)))  # derivations may run through not-yet-claimed tails
    # jax.nn.softmax on bf16 logits sums the exponentials in float32: the sum reads a cast of them
    e_var, l_var = _strip_casts(part, rsum.invars[0], set(chain)), rsum.outvars[0]
    pe = g.producer.get(e_var)
    if pe is None or g.eqns[pe].primitive.name != "exp":
        return False
    ps = g.producer.get(g.eqns[pe].invars[0])
    if ps is None or g.eqns[ps].primitive.name != "sub":
        return False
    a, b = g.eqns[ps].invars
    if a is not logits or not _derived_only_from(part, b, m, within):
        return False
    probs = _strip_casts(part, info.probs, set(chain))
    if probs is e_var:
        info.normalised_before_pv = False
    else:
        pd = g.producer.get(probs)
        if pd is None or g.eqns[pd].primitive.name != "div":
            return False
        num, den = g.eqns[pd].invars
        if num is not e_var or not _derived_only_from(part, den, l_var, within):
            return False
        info.normalised_before_pv = True
    # nothing else may read the exponentials or the logits
    allowed_e = {pe} | {pd for pd in chain if e_var in g.eqns[pd].invars}
    for c in g.consumers.get(e_var, []):
        if c not in allowed_e:
            return False
    info.row_max, info.row_sum, info.logits = m, l_var, logits
    return True
