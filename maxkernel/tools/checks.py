"""Does Pallas do the work? A static check of the candidate's jaxpr.

Outside `pallas_call` the candidate may only rearrange data (reshape, transpose, pad, cast, slice, ...)
and do light elementwise work. Everything else found outside a kernel — a `dot_general`, a convolution, a
reduction, a loop, a sort — is rejected, and the rules are an allow-list, so a primitive this module has
never heard of counts as heavy rather than slipping through. Host callbacks are rejected anywhere: they
would let Python compute the answer behind the tracer's back.

The check reads a `program_tree` tree (plain data from the candidate process), never a live jaxpr made by
candidate code. Work inside a conditional earns no credit beyond its cheapest branch (a dead branch with
a big dot in it pays for nothing), and kernels under a top-level conditional earn none at all. The same
rules are applied once more, by `stablehlo_check`, to the program compiled for the TPU.

Two more rules catch kernels that exist only for show: every kernel must do arithmetic (a kernel that only
copies a jnp-computed result is rejected), and elementwise work outside kernels must not outweigh the work
inside them.
"""

from __future__ import annotations

from typing import Any

from maxkernel.tools.jaxpr import (
    ELEMENTWISE_OUTSIDE,
    FORBIDDEN,
    KERNEL_DATA_MOVEMENT,
    LAYOUT_OUTSIDE,
    PLATFORM_DEPENDENT,
    REDUCTIONS,
    STRUCTURAL,
    WARN_ONLY,
)
from maxkernel.tools.program_tree import MAX_EQNS, Tree, size_of, to_tree, tree_eqns
from maxkernel.tools.results import PallasCheck


def _size(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d if d > 0 else 1
    return n


def _out_elems(eqn: Tree) -> int:
    return sum(_size(o) for o in eqn.get("out", []))


REF_WRITERS = frozenset({"swap", "masked_swap", "addupdate", "store"})
"""Kernel equations that write their first operand (a ref): live when that ref is."""
ZERO_PROPAGATING = frozenset(
    {"broadcast_in_dim", "convert_element_type", "reshape", "squeeze", "expand_dims"}
)


SELF_CANCELLING = frozenset({"sub", "xor"})
"""Binary ops whose result is zero when both operands are one value (`t - t`: zero for every finite t)."""


def _zero_vars(body: Tree) -> set[int]:
    """Variables of a body that are all zeros by construction: a zero literal broadcast or cast, a product
    with such a value, or a value minus itself. Work whose only use is such a value reaches no output: a
    zero does not depend on what it was computed from."""
    zeros: set[int] = set()
    for eqn in body.get("eqns", []):
        name = eqn.get("p", "")
        lits = eqn.get("lit") or {}
        ivs = eqn.get("iv", [])
        zero_in = [lits.get(str(i)) == 0.0 or (v >= 0 and v in zeros) for i, v in enumerate(ivs)]
        cancels = name in SELF_CANCELLING and len(ivs) == 2 and ivs[0] >= 0 and ivs[0] == ivs[1]
        if (
            (name in ZERO_PROPAGATING and zero_in[:1] == [True])
            or (name == "mul" and any(zero_in))
            or cancels
        ):
            zeros.update(v for v in eqn.get("ov", []) if v >= 0)
    return zeros


def live_eqns(body: Tree, live_refs: set[int]) -> list[bool]:
    """Per equation of one body level: does its result reach `live_refs` (the kernel's output refs),
    directly or through refs written and read again (scratch accumulators)? An equation with no results
    counts as live (a side effect: pl.when bodies, run_scoped, DMA); a product with zero passes nothing on."""
    eqns = body.get("eqns", [])
    zeros = _zero_vars(body)
    live = set(live_refs)
    marked = [False] * len(eqns)
    changed = True
    while changed:
        changed = False
        for i in range(len(eqns) - 1, -1, -1):
            if marked[i]:
                continue
            eqn = eqns[i]
            ivs, ovs = eqn.get("iv", []), eqn.get("ov", [])
            name = eqn.get("p", "")
            if name in REF_WRITERS:
                hit = bool(ivs) and ivs[0] in live
            else:
                hit = not ovs or any(v in live for v in ovs)
            if not hit:
                continue
            marked[i] = changed = True
            if name == "mul" and any(v in zeros for v in ivs) or any(v in zeros for v in ovs):
                continue  # its result is zero whatever its other operand is
            live.update(v for v in ivs if v >= 0 and v not in zeros)  # a zero operand passes nothing on
    return marked


def kernel_work(body: Tree, live_refs: set[int] | None = None) -> tuple[float, int]:
    """(work, number of compute equations) of one kernel body, for a single grid step.

    Only work whose result reaches an output counts (`live_eqns`, when `live_refs` names the output refs):
    a busy loop whose result is thrown away, or multiplied by zero, earns nothing. Work under a `cond`
    (which is what `pl.when` and `lax.cond` become) counts at its *cheapest* branch: only work that runs
    whichever way the branch goes earns credit, so a large dot in a branch that is never taken cannot pay
    for work done outside the kernel. Equations are counted in every branch (a kernel whose arithmetic
    sits under `pl.when` is still not a copy-only kernel).
    """
    work = 0.0
    ops = 0
    eqns = body.get("eqns", [])
    alive = live_eqns(body, live_refs) if live_refs is not None else [True] * len(eqns)
    for eqn, is_live in zip(eqns, alive, strict=True):
        name = eqn.get("p", "")
        if "branches" in eqn:
            results = [kernel_work(b) for b in eqn["branches"]]
            if results:
                work += min(w for w, _ in results) if is_live else 0.0
                ops += max(n for _, n in results)
            continue
        trips = int(eqn.get("length", 1)) if name == "scan" else 1
        for sub in eqn.get("subs", []):
            w, n = kernel_work(sub)
            work += trips * w if is_live else 0.0
            ops += n
        if name in KERNEL_DATA_MOVEMENT or name in STRUCTURAL:
            continue
        ops += 1
        if is_live:
            work += 2.0 * _out_elems(eqn) * int(eqn.get("k", 1)) if name == "dot_general" else _out_elems(eqn)
    return work, ops


def output_refs(eqn: Tree) -> set[int]:
    """The variables of a pallas_call's body that are its output refs (after scalar prefetch and inputs)."""
    body = eqn.get("body", {})
    invars = body.get("invars")
    if not isinstance(invars, list):
        return set()
    start = len(eqn.get("in", []))  # scalar prefetch operands and inputs come first
    return {v for v in invars[start : start + int(eqn.get("n_out", 0))] if isinstance(v, int)}


def _grid_steps(eqn: Tree) -> int:
    steps = 1
    for g in eqn.get("grid", []):
        steps *= g if g > 0 else 1
    return steps


GLUE_COSTED = REDUCTIONS | frozenset({"dot_general", "conv_general_dilated", "argmax", "argmin"})
"""Outside kernels, allowed when small (judged by cost): reductions, scans along an axis, dots."""
GLUE_FRACTION = 1 / 8
"""Glue outside the kernels may process at most this fraction of the elements the kernels read and write:
a 512-element mean after a kernel that did the per-row work is glue, a whole reduction is not."""
ELEMENTWISE_IO_FACTOR = 4.0
"""Elementwise work outside the kernels may write at most this many times the elements the program and
its kernels read and write: a matmul done as a broadcast multiply and an add tree is far above it."""


def _row_scatter(eqn: Tree) -> bool:
    """A scatter that replaces (`x.at[i].set(u)`) or adds (`.add(u)`) and nothing else: in place, one write
    or one add per update element, so it is elementwise work on its updates (held to the same budgets as
    maps outside kernels, and to no more than the kernels' work); the TPU program's rule is the same
    (`stablehlo_check.ROW_SCATTER_REGIONS`). `scatter_apply` (a `scatter` with a function) and multiplying
    or min/max scatters stay heavy work."""
    name = eqn.get("p")
    if name not in ("scatter", "scatter-add") or len(eqn.get("in", [])) != 3:
        return False
    body = [e.get("p") for sub in eqn.get("subs", []) for e in tree_eqns(sub)]
    return body == ([] if name == "scatter" else ["add"])


def _glue_cost(eqn: Tree) -> float:
    """Elements a costed op processes: its operands for a reduction, M*N*K for a dot."""
    if eqn.get("p") == "dot_general":
        return _out_elems(eqn) * int(eqn.get("k", 1))
    return float(sum(_size(s) for s in eqn.get("in", []))) or float(_out_elems(eqn))


class _Walker:
    def __init__(self) -> None:
        self.check = PallasCheck(ok=True)
        self.copy_only_kernels = 0
        self.conditional_kernels = 0
        self.warnings: list[str] = []
        self.kernel_io = 0.0
        self.glue: list[str] = []
        self.glue_cost = 0.0

    def walk(self, tree: Tree, conditional: bool = False) -> None:
        for eqn in tree.get("eqns", []):
            name = eqn.get("p", "")
            if name == "pallas_call":
                self.check.pallas_calls += 1
                body = eqn.get("body", {})
                refs = output_refs(eqn)
                work, ops = kernel_work(body, refs if refs else None)
                self._forbidden_inside(body)
                if ops == 0:
                    self.copy_only_kernels += 1
                if conditional:
                    self.conditional_kernels += 1  # may never run: no credit for its work
                else:
                    self.check.work_inside += work * _grid_steps(eqn)
                    self.kernel_io += sum(_size(s) for s in eqn.get("in", [])) + _out_elems(eqn)
                continue
            if name in FORBIDDEN or name in PLATFORM_DEPENDENT:
                self.check.forbidden.append(name)
                continue
            if _row_scatter(eqn):  # one add (or write) per update element: elementwise work on its rows
                shapes = ", ".join("[" + ",".join(map(str, o)) + "]" for o in eqn.get("out", []))
                self.check.elementwise_outside.append(f"{name} of {_size(eqn['in'][2])} elements -> {shapes}")
                self.check.work_outside += _size(eqn["in"][2])
                continue
            if name in GLUE_COSTED:
                cost = _glue_cost(eqn)
                self.glue_cost += cost
                shapes = ", ".join("[" + ",".join(map(str, o)) + "]" for o in eqn.get("out", []))
                self.glue.append(f"{name} -> {shapes} ({cost:.4g} elements)")
                continue
            if name in WARN_ONLY:
                self.warnings.append(f"{name} outside Pallas")
                continue
            if name in STRUCTURAL:
                for sub in eqn.get("subs", []):
                    self.walk(sub, conditional)
                for sub in eqn.get("branches", []):
                    self.walk(sub, True)
                continue
            if name in LAYOUT_OUTSIDE:
                continue
            shapes = ", ".join("[" + ",".join(map(str, o)) + "]" for o in eqn.get("out", []))
            if name in ELEMENTWISE_OUTSIDE:
                self.check.elementwise_outside.append(f"{name} -> {shapes}")
                self.check.work_outside += _out_elems(eqn)
            else:
                self.check.heavy_outside.append(f"{name} -> {shapes}")

    def _forbidden_inside(self, tree: Tree) -> None:
        for eqn in tree_eqns(tree):
            if eqn.get("p") in FORBIDDEN or eqn.get("p") in PLATFORM_DEPENDENT:
                self.check.forbidden.append(f"{eqn.get('p')} (inside a kernel)")


def check_pallas_does_work(program: Any) -> tuple[PallasCheck, list[str]]:
    """Classify a candidate's program: a `program_tree` tree (what the judge gets) or a jaxpr (our own
    code, e.g. tests and the offline author), which is converted first. Returns the check and warnings to
    surface (e.g. debug prints)."""
    tree = program if isinstance(program, dict) else to_tree(program)
    if size_of(tree) > MAX_EQNS:
        return PallasCheck(ok=False, reason=f"the program has more than {MAX_EQNS} equations"), []
    walker = _Walker()
    walker.walk(tree)
    c = walker.check
    warnings = list(walker.warnings)
    if walker.glue and walker.glue_cost <= GLUE_FRACTION * walker.kernel_io:
        warnings.append("small glue outside Pallas (allowed by its cost): " + "; ".join(walker.glue[:3]))
    if c.elementwise_outside:
        warnings.append(
            f"{len(c.elementwise_outside)} elementwise op(s) run outside Pallas: "
            + "; ".join(c.elementwise_outside[:5])
        )
    program_io = float(sum(_size(s) for s in [*tree.get("in", []), *tree.get("outs", [])]))
    platform = [f for f in c.forbidden if f.split(" ")[0] in PLATFORM_DEPENDENT]
    if platform:
        c.ok, c.reason = (
            False,
            (
                "platform-dependent lowering (lax.platform_dependent: "
                + ", ".join(sorted(set(platform)))
                + ") is refused: the CPU interpreter that checks the kernel and the TPU that runs it would take "
                "different branches"
            ),
        )
    elif c.forbidden:
        c.ok, c.reason = False, "host callbacks are not allowed: " + ", ".join(sorted(set(c.forbidden)))
    elif c.pallas_calls == 0:
        c.ok, c.reason = False, "no pallas_call in the candidate: the work is not done in Pallas"
    elif c.heavy_outside:
        c.ok = False
        c.reason = "work outside Pallas kernels: " + "; ".join(c.heavy_outside[:6])
    elif walker.glue_cost > GLUE_FRACTION * walker.kernel_io:
        c.ok = False
        c.heavy_outside = list(walker.glue)
        c.reason = (
            "work outside Pallas kernels: "
            + "; ".join(walker.glue[:6])
            + f" ({walker.glue_cost:.4g} elements; "
            f"glue may process at most {GLUE_FRACTION:g} of the {walker.kernel_io:.4g} elements the kernels "
            "read and write)"
        )
    elif walker.conditional_kernels == c.pallas_calls:
        c.ok = False
        c.reason = "every pallas_call sits under a conditional (lax.cond/switch): no kernel surely runs"
    elif walker.copy_only_kernels == c.pallas_calls:
        c.ok = False
        c.reason = "the Pallas kernels only move data; the arithmetic happens outside them"
    elif c.work_outside > ELEMENTWISE_IO_FACTOR * (program_io + walker.kernel_io):
        c.ok = False
        c.reason = (
            f"elementwise work outside Pallas ({c.work_outside:.4g} element-ops) is over "
            f"{ELEMENTWISE_IO_FACTOR:g}x the elements the program and its kernels read and write "
            f"({program_io + walker.kernel_io:.4g}): work, not glue"
        )
    elif c.work_outside > c.work_inside:
        c.ok = False
        c.reason = (
            f"most elementwise work runs outside Pallas ({c.work_outside:.3g} element-ops outside vs "
            f"{c.work_inside:.3g} inside, counting only work that runs whichever way a branch goes)"
        )
    return c, warnings
