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


def kernel_work(body: Tree) -> tuple[float, int]:
    """(work, number of compute equations) of one kernel body, for a single grid step.

    Work under a `cond` (which is what `pl.when` and `lax.cond` become) counts at its *cheapest* branch:
    only work that runs whichever way the branch goes earns credit, so a large dot in a branch that is
    never taken cannot pay for work done outside the kernel. Equations are counted in every branch (a
    kernel whose arithmetic sits under `pl.when` is still not a copy-only kernel).
    """
    work = 0.0
    ops = 0
    for eqn in body.get("eqns", []):
        name = eqn.get("p", "")
        if "branches" in eqn:
            results = [kernel_work(b) for b in eqn["branches"]]
            if results:
                work += min(w for w, _ in results)
                ops += max(n for _, n in results)
            continue
        trips = int(eqn.get("length", 1)) if name == "scan" else 1
        for sub in eqn.get("subs", []):
            w, n = kernel_work(sub)
            work += trips * w
            ops += n
        if name in KERNEL_DATA_MOVEMENT or name in STRUCTURAL:
            continue
        ops += 1
        work += 2.0 * _out_elems(eqn) * int(eqn.get("k", 1)) if name == "dot_general" else _out_elems(eqn)
    return work, ops


def _grid_steps(eqn: Tree) -> int:
    steps = 1
    for g in eqn.get("grid", []):
        steps *= g if g > 0 else 1
    return steps


class _Walker:
    def __init__(self) -> None:
        self.check = PallasCheck(ok=True)
        self.copy_only_kernels = 0
        self.conditional_kernels = 0
        self.warnings: list[str] = []

    def walk(self, tree: Tree, conditional: bool = False) -> None:
        for eqn in tree.get("eqns", []):
            name = eqn.get("p", "")
            if name == "pallas_call":
                self.check.pallas_calls += 1
                body = eqn.get("body", {})
                work, ops = kernel_work(body)
                self._forbidden_inside(body)
                if ops == 0:
                    self.copy_only_kernels += 1
                if conditional:
                    self.conditional_kernels += 1  # may never run: no credit for its work
                else:
                    self.check.work_inside += work * _grid_steps(eqn)
                continue
            if name in FORBIDDEN:
                self.check.forbidden.append(name)
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
            if eqn.get("p") in FORBIDDEN:
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
    if c.elementwise_outside:
        warnings.append(
            f"{len(c.elementwise_outside)} elementwise op(s) run outside Pallas: "
            + "; ".join(c.elementwise_outside[:5])
        )
    if c.forbidden:
        c.ok, c.reason = False, "host callbacks are not allowed: " + ", ".join(sorted(set(c.forbidden)))
    elif c.pallas_calls == 0:
        c.ok, c.reason = False, "no pallas_call in the candidate: the work is not done in Pallas"
    elif c.heavy_outside:
        c.ok = False
        c.reason = "work outside Pallas kernels: " + "; ".join(c.heavy_outside[:6])
    elif walker.conditional_kernels == c.pallas_calls:
        c.ok = False
        c.reason = "every pallas_call sits under a conditional (lax.cond/switch): no kernel surely runs"
    elif walker.copy_only_kernels == c.pallas_calls:
        c.ok = False
        c.reason = "the Pallas kernels only move data; the arithmetic happens outside them"
    elif c.work_outside > c.work_inside:
        c.ok = False
        c.reason = (
            f"most elementwise work runs outside Pallas ({c.work_outside:.3g} element-ops outside vs "
            f"{c.work_inside:.3g} inside, counting only work that runs whichever way a branch goes)"
        )
    return c, warnings
