"""A jaxpr as plain data: what the candidate process hands the judge instead of a live object.

The candidate process traces the candidate (it must: tracing runs the candidate's Python) and turns the
jaxpr into a JSON tree with only what the checks read: per equation the primitive name, output shapes,
the contraction size of a dot, a scan's trip count, a pallas_call's grid and block shapes, and nested
programs (cond branches marked as such). The judge side (`checks`, `skeleton`) reads only this tree and
never imports JAX objects made by the candidate.

The tree is data produced in an untrusted process: a candidate that rewrites this module in its own
process can hand over a tree of a different program. Two things limit what that buys (see `harness`):
the TPU program is handed over separately as a serialized `jax.export` artifact, which the judge inspects
and compiles itself, and the two must agree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from itertools import chain
from typing import Any

from maxkernel.tools.jaxpr import SHAPE_MASKING

Tree = dict[str, Any]
MAX_EQNS = 200_000
"""A tree larger than this is refused rather than walked (a candidate could send a huge one)."""


def _shape(aval: Any) -> list[int]:
    return [int(d) if isinstance(d, int) else -1 for d in getattr(aval, "shape", ())]


def _closed_jaxprs(value: Any) -> list[Any]:
    items = value if isinstance(value, list | tuple) else (value,)
    out = []
    for item in items:
        inner = getattr(item, "jaxpr", None)
        if hasattr(item, "eqns"):
            out.append(item)
        elif inner is not None and hasattr(inner, "eqns"):
            out.append(inner)
    return out


def _block_dim(b: Any) -> int:
    """One block dimension: an int, `pl.Blocked(n)`; -1 for a squeezed or unknown one."""
    if isinstance(b, int):
        return b
    size = getattr(b, "block_size", None)
    return int(size) if isinstance(size, int) else -1


def _literal(v: Any) -> float | None:
    """A scalar literal operand's value (a jaxpr `Literal`), else None."""
    val = getattr(v, "val", None)
    if val is None or getattr(val, "shape", ()) != ():
        return None
    try:
        return float(val)
    except (TypeError, ValueError):
        return None


def to_tree(jaxpr: Any) -> Tree:
    """Serialise a (closed) jaxpr into the tree the checks read. Each equation carries its operands' and
    results' shapes, variable numbers local to its jaxpr (`iv`/`ov`: what feeds what, for the liveness of
    kernel work), and scalar literal operands (`lit`: operand position -> value)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr) if not hasattr(jaxpr, "eqns") else jaxpr
    ids: dict[Any, int] = {}

    def vid(v: Any) -> int:
        if _literal(v) is not None or not hasattr(v, "aval") or type(v).__name__ == "Literal":
            return -1
        return ids.setdefault(v, len(ids))

    invars = [vid(v) for v in jaxpr.invars]
    eqns = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        node: Tree = {
            "p": name,
            "out": [_shape(v.aval) for v in eqn.outvars],
            "in": [_shape(getattr(v, "aval", None)) for v in eqn.invars],
            "iv": [vid(v) for v in eqn.invars],
            "ov": [vid(v) for v in eqn.outvars],
        }
        lits = {str(i): x for i, v in enumerate(eqn.invars) if (x := _literal(v)) is not None}
        if lits:
            node["lit"] = lits
        params = eqn.params
        if name == "dot_general":
            lhs = eqn.invars[0].aval
            (contract_lhs, _), _ = params["dimension_numbers"]
            k = 1
            for axis in contract_lhs:
                k *= int(lhs.shape[axis])
            node["k"] = k
        if name == "scan":
            node["length"] = int(params.get("length", 1))
        if name == "pallas_call":
            gm = params.get("grid_mapping")
            node["grid"] = [int(g) if isinstance(g, int) else -1 for g in (getattr(gm, "grid", ()) or ())]
            node["blocks"] = [
                [_block_dim(b) for b in (getattr(bm, "block_shape", ()) or ())]
                for bm in (getattr(gm, "block_mappings", ()) or ())
            ]
            node["n_prefetch"] = int(getattr(gm, "num_index_operands", 0) or 0)
            node["body"] = to_tree(params["jaxpr"])
            node["n_out"] = len(eqn.outvars)
        elif name == "cond":
            node["branches"] = [to_tree(b) for b in _closed_jaxprs(params.get("branches", ()))]
        else:
            subs = [to_tree(j) for v in params.values() for j in _closed_jaxprs(v)]
            if subs:
                node["subs"] = subs
        eqns.append(node)
    return {
        "eqns": eqns,
        "invars": invars,
        "outvars": [vid(v) for v in jaxpr.outvars],
        "in": [_shape(v.aval) for v in jaxpr.invars],
        "outs": [_shape(getattr(v, "aval", None)) for v in jaxpr.outvars],
    }


def tree_eqns(tree: Tree, *, kernels: bool = False) -> Iterator[Tree]:
    """Every equation of a tree and of the trees nested in it (call bodies, cond branches and, with
    `kernels`, pallas_call kernel bodies), depth first in program order. Iterative: a hostile tree nested
    deeper than Python's recursion limit is walked, not a crash."""
    end = object()
    stack: list[Iterator[Any]] = [iter(tree.get("eqns", []))]
    while stack:
        eqn = next(stack[-1], end)
        if eqn is end:
            stack.pop()
            continue
        yield eqn
        nested = [*eqn.get("subs", []), *eqn.get("branches", [])]
        if kernels and "body" in eqn:
            nested.append(eqn["body"])
        if nested:
            stack.append(chain.from_iterable(t.get("eqns", []) for t in nested))


def size_of(tree: Tree) -> int:
    """Equations in the tree, all levels (stops counting past MAX_EQNS)."""
    n = 0
    for _ in tree_eqns(tree, kernels=True):
        n += 1
        if n > MAX_EQNS:
            break
    return n


def _prims(tree: Tree) -> Counter[str]:
    return Counter(str(e.get("p")) for e in tree_eqns(tree, kernels=True))


def skeleton(tree: Tree) -> dict[str, Any]:
    """The structure two traces of one program must share: per pallas_call (in order) the kernel body's
    primitive multiset, the grid rank and the number of blocks, plus the primitive multiset outside."""
    kernels: list[dict[str, Any]] = []
    outside: Counter[str] = Counter()

    for e in tree_eqns(tree):
        if e.get("p") == "pallas_call":
            kernels.append(
                {
                    "prims": dict(sorted(_prims(e.get("body", {})).items())),
                    "grid_rank": len(e.get("grid", [])),
                    "blocks": len(e.get("blocks", [])),
                }
            )
        else:
            outside[str(e.get("p"))] += 1
    return {"kernels": kernels, "outside": dict(sorted(outside.items()))}


def same_program(a: dict[str, Any], b: dict[str, Any], *, exact: bool) -> str | None:
    """None if two skeletons are the same program, else what differs. `exact=False` (traces at different
    shapes) compares primitive *sets* less the masking/padding primitives (`SHAPE_MASKING`): a kernel may
    legitimately unroll, mask or pad differently per shape, but not change what it computes, move work out
    of Pallas or drop a kernel."""

    def prims(d: dict[str, Any]) -> Any:
        return d if exact else set(d) - SHAPE_MASKING

    ka, kb = a.get("kernels", []), b.get("kernels", [])
    if len(ka) != len(kb):
        return f"{len(ka)} pallas_call(s) vs {len(kb)}"
    for i, (x, y) in enumerate(zip(ka, kb, strict=True)):
        if x.get("grid_rank") != y.get("grid_rank") or x.get("blocks") != y.get("blocks"):
            return f"kernel {i}: grid rank/blocks {x.get('grid_rank')}/{x.get('blocks')} vs {y.get('grid_rank')}/{y.get('blocks')}"
        px, py = x.get("prims", {}), y.get("prims", {})
        if prims(px) != prims(py):
            diff = sorted(set(prims(px)).symmetric_difference(prims(py))) or sorted(
                k for k in px if px[k] != py.get(k)
            )
            return f"kernel {i}: different operations ({', '.join(diff[:6])})"
    oa, ob = a.get("outside", {}), b.get("outside", {})
    if prims(oa) != prims(ob):
        diff = sorted(set(prims(oa)).symmetric_difference(prims(ob))) or sorted(
            k for k in oa if oa[k] != ob.get(k)
        )
        return f"operations outside the kernels differ ({', '.join(diff[:6])})"
    return None
