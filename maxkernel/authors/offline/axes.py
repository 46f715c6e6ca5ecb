"""Which dimensions of which values are "the same axis": a union-find over (var, dim) pairs.

Inside one kernel every value lives on a shared iteration space. Elementwise ops tie their operands'
dims together, broadcasts tie the kept dims, transposes permute, reductions tie the kept dims and mark the
reduced ones, `dot_general` ties batch dims, free dims and the two contracting dims. After a region's
equations are added, each equivalence class is one axis of the kernel's iteration space; a transpose or a
broadcast inside the region costs nothing because it only relabels dims.

Dims that are 1 in every input configuration are broadcast dims and take no part.
"""

from __future__ import annotations

from typing import Any

from maxkernel.authors.offline.dataflow import Graph, is_literal, reduced_axes

Node = tuple[Any, int]


class Conflict(Exception):
    """The equations cannot share one iteration space (a value would need two dims on one axis)."""


class Axes:
    def __init__(self, graph: Graph) -> None:
        self.g = graph
        self.parent: dict[Node, Node] = {}
        self.reduced: set[Node] = set()
        self.contracted: set[Node] = set()

    def copy(self) -> Axes:
        a = Axes(self.g)
        a.parent = dict(self.parent)
        a.reduced = set(self.reduced)
        a.contracted = set(self.contracted)
        return a

    # --- union-find -----------------------------------------------------------------------------------
    def _node(self, var: Any, dim: int) -> Node | None:
        if is_literal(var) or self.g.unit(var, dim):
            return None
        n = (var, dim)
        if n not in self.parent:
            self.parent[n] = n
        return n

    def find(self, n: Node) -> Node:
        root = n
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[n] != root:
            self.parent[n], n = root, self.parent[n]
        return root

    def union(self, a: Node | None, b: Node | None) -> None:
        if a is None or b is None:
            return
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        if self.g.traces.shapes(ra[0]) and [s[ra[1]] for s in self.g.traces.shapes(ra[0])] != [
            s[rb[1]] for s in self.g.traces.shapes(rb[0])
        ]:
            raise Conflict("dims of different sizes on one axis")
        self.parent[rb] = ra

    # --- queries --------------------------------------------------------------------------------------
    def cls(self, var: Any, dim: int) -> Node | None:
        n = self._node(var, dim)
        return None if n is None else self.find(n)

    def classes(self, var: Any) -> list[Node | None]:
        if is_literal(var):
            return []
        return [self.cls(var, d) for d in range(len(var.aval.shape))]

    def footprint(self, var: Any) -> set[Node]:
        return {c for c in self.classes(var) if c is not None}

    def extent(self, c: Node) -> int:
        var, dim = c
        return int(var.aval.shape[dim])

    def extents_all(self, c: Node) -> list[int]:
        var, dim = c
        return [s[dim] for s in self.g.traces.shapes(var)]

    def reduced_classes(self) -> set[Node]:
        return {self.find(n) for n in self.reduced}

    def contracted_classes(self) -> set[Node]:
        return {self.find(n) for n in self.contracted}

    def check_distinct(self, vars_: list[Any]) -> None:
        for v in vars_:
            cs = [c for c in self.classes(v) if c is not None]
            if len(set(cs)) != len(cs):
                raise Conflict(f"a value would need two of its dims on one axis ({v.aval.str_short()})")

    # --- constraints ----------------------------------------------------------------------------------
    def add(self, eqn: Any) -> None:
        """Tie the dims of one equation's operands and results. Raises `Conflict`."""
        name = eqn.primitive.name
        outs = eqn.outvars
        ins = eqn.invars
        out = outs[0]
        for v in outs:
            for d in range(len(v.aval.shape)):
                self._node(v, d)
        if name == "broadcast_in_dim":
            x = ins[0]
            for i, d in enumerate(eqn.params["broadcast_dimensions"]):
                self.union(self._node(x, i), self._node(out, d))
        elif name == "transpose":
            for i, p in enumerate(eqn.params["permutation"]):
                self.union(self._node(ins[0], p), self._node(out, i))
        elif name in ("reshape", "squeeze", "expand_dims"):
            a = self.g.nonunit_dims(ins[0])
            b = self.g.nonunit_dims(out)
            if len(a) != len(b):
                raise Conflict("a reshape that splits or merges dims")
            for i, j in zip(a, b, strict=True):
                self.union(self._node(ins[0], i), self._node(out, j))
        elif name == "top_k":  # the reduced axis becomes k winners: a new axis of its own
            x = ins[0]
            (axis,) = reduced_axes(eqn)
            for d in range(len(x.aval.shape)):
                if d != axis:
                    for o in outs:
                        self.union(self._node(x, d), self._node(o, d))
            for d in range(len(out.aval.shape)):
                self.union(self._node(outs[0], d), self._node(outs[1], d))
            # both the input axis and the k winners must be whole in a block: every round picks across
            # the whole input axis and writes one of the k slots (a k axis the kernel writes out as it is,
            # e.g. the indices alone, was otherwise tiled like any output axis and refused)
            for n in (self._node(x, axis), self._node(out, axis)):
                if n is not None:
                    self.reduced.add(n)
        elif name in (
            "reduce_sum",
            "reduce_max",
            "reduce_min",
            "argmax",
            "argmin",
            "reduce_and",
            "reduce_or",
        ):
            axes = tuple(reduced_axes(eqn))
            x = ins[0]
            kept = [d for d in range(len(x.aval.shape)) if d not in axes]
            for i, d in enumerate(kept):
                self.union(self._node(x, d), self._node(out, i))
            for d in axes:
                n = self._node(x, d)
                if n is not None:
                    self.reduced.add(n)
        elif name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            lhs, rhs = ins
            for a, b in zip(lc, rc, strict=True):
                na, nb = self._node(lhs, a), self._node(rhs, b)
                self.union(na, nb)
                for n in (na, nb):
                    if n is not None:
                        self.contracted.add(n)
            for i, (a, b) in enumerate(zip(lb, rb, strict=True)):
                self.union(self._node(lhs, a), self._node(rhs, b))
                self.union(self._node(lhs, a), self._node(out, i))
                self.union(self._node(rhs, b), self._node(out, i))
            lf = [d for d in range(len(lhs.aval.shape)) if d not in lc and d not in lb]
            rf = [d for d in range(len(rhs.aval.shape)) if d not in rc and d not in rb]
            pos = len(lb)
            for d in lf:
                self.union(self._node(lhs, d), self._node(out, pos))
                pos += 1
            for d in rf:
                self.union(self._node(rhs, d), self._node(out, pos))
                pos += 1
        elif name == "ragged_dot_general":
            lhs, rhs, sizes = ins
            rdn = eqn.params["ragged_dot_dimension_numbers"]
            if tuple(rdn.rhs_group_dimensions) == ():  # ragged contraction: [m,k] x [m,n] -> [g,k,n]
                self.union(self._node(lhs, 0), self._node(rhs, 0))
                self.union(self._node(lhs, 1), self._node(out, 1))
                self.union(self._node(rhs, 1), self._node(out, 2))
                self.union(self._node(sizes, 0), self._node(out, 0))
                for n in (self._node(lhs, 0),):
                    if n is not None:
                        self.contracted.add(n)
                self.check_distinct([v for v in (*ins, *outs) if not is_literal(v)])
                return
            self.union(self._node(lhs, 1), self._node(rhs, 1))
            self.union(self._node(lhs, 0), self._node(out, 0))
            self.union(self._node(rhs, 2), self._node(out, 1))
            self.union(self._node(rhs, 0), self._node(sizes, 0))
            for n in (self._node(lhs, 1), self._node(rhs, 0)):
                if n is not None:
                    self.contracted.add(n)
        elif name == "iota":
            pass
        else:  # elementwise (and convert/copy): same-shape operands
            rank = len(out.aval.shape)
            for x in ins:
                if is_literal(x) or len(x.aval.shape) != rank:
                    continue
                for d in range(rank):
                    self.union(self._node(x, d), self._node(out, d))
            for o in outs[1:]:
                for d in range(rank):
                    self.union(self._node(o, d), self._node(out, d))
        self.check_distinct([v for v in (*ins, *outs) if not is_literal(v)])
