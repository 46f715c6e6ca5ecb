"""Row-wise and elementwise kernels: one block of rows per grid step, or reductions walked in blocks."""

from __future__ import annotations

import math
from typing import Any

from maxkernel.authors.offline.axes import Axes, Conflict, Node
from maxkernel.authors.offline.dataflow import is_literal, reduced_axes
from maxkernel.authors.offline.kernels import (
    Scope,
    Space,
    SpaceDim,
    nbytes,
    nelems,
    op_summary,
)
from maxkernel.authors.offline.online import online_sums
from maxkernel.authors.offline.spec import BufferSpec
from maxkernel.authors.offline.stream_reduce import StreamedReductions

SMALL_TILE_BYTES = 256 * 1024
"""An elementwise map whose whole trailing (rows, lanes) tile is smaller than this also blocks the axis ahead
of it (`MapBuilder._small_tile`); the tuner sizes that block towards ~1 MiB per step."""


class MapBuilder(StreamedReductions):
    """Elementwise maps and reductions along whole trailing axes: one block of rows per grid step."""

    family = "rowwise"

    def make_space(self) -> None:
        if not self.region.stream:
            self.ax = self._share_dead_axes()
        ax = self.ax
        g = self.g
        region_vars = [
            v
            for i in self.region.eqns()
            for v in (*g.eqns[i].invars, *g.eqns[i].outvars)
            if not is_literal(v)
        ]
        # Class order: the layout of the biggest operand, so that most operands need no transpose.
        io = [*self.inputs, *self.outputs]
        dominant = sorted(io, key=lambda v: (-len(ax.footprint(v)), -nelems(v)))
        order: list[Node] = []
        for v in [*dominant, *region_vars]:
            for c in ax.classes(v):
                if c is not None and c not in order:
                    order.append(c)
        reduced = ax.reduced_classes()
        self.stream = self.region.stream
        if not reduced:
            self.family = "elementwise"
            self.stem = self.stem.replace("_rowwise", "_elementwise")
        elif self.stream:
            self.family = "reduction"
            self.stem = self.stem.replace("_rowwise", "_reduction")
        red_sig: dict[Node, frozenset[int]] = {}
        for i in self.region.eqns():
            e = g.eqns[i]
            if g.kind[i] == "reduce":
                for a in reduced_axes(e):
                    c = ax.cls(e.invars[0], a)
                    if c is not None:
                        red_sig[c] = red_sig.get(c, frozenset()) | {i}

        def span_sig(c: Node) -> frozenset[int]:
            return frozenset(k for k, v in enumerate(io) if c in ax.footprint(v))

        def key(c: Node) -> Any:
            if self.stream and c in reduced:
                return ("streamed",)
            return (red_sig.get(c), span_sig(c))

        def grouped(order: list[Node]) -> list[list[Node]]:
            out: list[list[Node]] = []
            for c in order:
                if out and key(out[-1][0]) == key(c):
                    out[-1].append(c)
                else:
                    out.append([c])
            return out

        groups = grouped(order)
        if self.stream and sum(1 for grp in groups if grp[0] in reduced) != 1:
            # the streamed axes must be one dim: move them last (the operands get transposed outside)
            groups = grouped([c for c in order if c not in reduced] + [c for c in order if c in reduced])
        ext = lambda grp: math.prod(ax.extent(c) for c in grp)  # noqa: E731
        if not reduced:
            groups = self._widen_lanes(groups, io)
        is_red = [grp[0] in reduced for grp in groups]
        if any(is_red):
            first = is_red.index(True)
            start = first - 1 if first > 0 else first
        else:
            start = max(len(groups) - 2, 0)
            if start > 0 and self._small_tile(groups[start:], io):
                start -= 1  # the innermost walked group becomes a leading block dim (BLOCK_LEAD)
        tile = groups[start:]
        grid = groups[:start]
        if not reduced and len(tile) == 1 and len(tile[0]) > 1:
            tile = self._rows_and_lanes(tile[0])
        # lanes want a long axis: move the longest tile group last when the natural last one is short, unless
        # a streamed reduction would pay for it with a transpose of an input in HBM (a batch norm's statistics
        # over (N, H, W) of a 64-channel activation: the transpose read and wrote the whole activation again,
        # where 64-lane blocks only leave half of each vreg idle in a pass bound by HBM anyway)
        if tile and ext(tile[-1]) < 128:
            longest = max(range(len(tile)), key=lambda k: ext(tile[k]) if tile[k][0] in reduced else 0)
            if (
                tile[longest][0] in reduced
                and ext(tile[longest]) > ext(tile[-1])
                and not (self.stream and self._transposes_an_input(tile, longest))
            ):
                tile.append(tile.pop(longest))
        if reduced and not self.stream:
            tile = self._long_sublanes(tile, io)
            tile = self._lane_dense(tile, reduced)
        dims: list[SpaceDim] = []
        for k, grp in enumerate(grid):
            dims.append(SpaceDim(key=f"g{k}" if len(grid) > 1 else "g", classes=grp, role="grid"))
        if len(tile) < 2:
            dims.append(SpaceDim(key="unit", classes=[], role="full"))
        n_lead = 0
        for pos, grp in enumerate(tile):
            if grp[0] in reduced:
                if self.stream:
                    dims.append(
                        SpaceDim(key="red", classes=grp, role="seq", param=f"{self.cprefix}BLOCK_RED")
                    )
                else:
                    k = sum(1 for x in tile[:pos] if x[0] in reduced)
                    n_red = sum(1 for x in tile if x[0] in reduced)
                    dims.append(SpaceDim(key=f"red{k}" if n_red > 1 else "red", classes=grp, role="full"))
                continue
            if pos == len(tile) - 1:
                name, kk = "BLOCK_COLS", "cols"
            elif pos == len(tile) - 2:
                name, kk = "BLOCK_ROWS", "rows"
            else:
                n_leads = sum(1 for q, x in enumerate(tile) if x[0] not in reduced and q < len(tile) - 2)
                name, kk = f"BLOCK_LEAD{n_lead if n_leads > 1 else ''}", f"lead{n_lead}"
                n_lead += 1
            dims.append(SpaceDim(key=kk, classes=grp, role="tiled", param=f"{self.cprefix}{name}"))
        axis = 0
        for d in dims:
            if d.role in ("grid", "tiled"):
                d.axis = axis
                axis += 1
        for d in dims:
            if d.role == "seq":
                d.axis = axis
                axis += 1
        if axis == 0:  # nothing to walk: one grid step over a size-1 axis
            dims[0].role = "tiled"
            dims[0].axis = 0
        self.dims = dims
        self.space = Space("tile", [d for d in dims if d.role != "grid"])

    def _transposes_an_input(self, tile: list[list[Node]], moved: int) -> bool:
        """Would moving tile group `moved` last reorder the dims of some input (one that spans it and a
        group after it), i.e. transpose that input in HBM before the kernel?"""
        later = {c for grp in tile[moved + 1 :] for c in grp}
        for v in self.inputs:
            fp = self.ax.footprint(v)
            if fp & set(tile[moved]) and fp & later:
                return True
        return False

    def _share_dead_axes(self) -> Axes:
        """Let an axis that a reduction consumes share its dim with an axis of the same extent that no value
        spans together with it (top_k over experts, then a one-hot back onto experts; an argmax, then a
        gather-free one-hot).

        Without this the two are separate dims of the kernel's space, and the values on either side of the
        reduction each hold a size-1 dim where the other one lives: with both in the (sublane, lane) tile,
        every row of the input and every element of the output filled a vreg of its own (top-k gating took
        4096 grid steps of (16, 32, 1, 1) output blocks, 0.14x of XLA per the block model). Sharing is
        sound because no equation combines the two positionally: an elementwise op over values spanning
        each would tie them into one class, so distinct classes that no value spans together are never
        broadcast against each other, and a value spanning neither broadcasts along the shared dim alike
        for both. The union checks that the extents agree in every traced input configuration."""
        ax = self.ax.copy()
        g = self.g
        values = list(
            dict.fromkeys(
                v
                for i in self.region.eqns()
                for v in (*g.eqns[i].invars, *g.eqns[i].outvars)
                if not is_literal(v)
            )
        )
        values += [v for v in (*self.inputs, *self.outputs) if v not in values]
        while True:
            reduced = ax.reduced_classes()
            classes = list(dict.fromkeys(c for v in values for c in ax.classes(v) if c is not None))
            footprints = [ax.footprint(v) for v in values]
            pair = next(
                (
                    (dead, born)
                    for dead in classes
                    if dead in reduced
                    for born in classes
                    if born not in reduced
                    and ax.extents_all(dead) == ax.extents_all(born)
                    and not any(dead in fp and born in fp for fp in footprints)
                ),
                None,
            )
            if pair is None:
                pair = self._independent_pair(ax, classes, reduced, footprints)
            if pair is None:
                return ax
            try:
                ax.union(*pair)
            except Conflict:
                return self.ax

    @staticmethod
    def _independent_pair(
        ax: Axes, classes: list[Node], reduced: set[Node], footprints: list[set[Node]]
    ) -> tuple[Node, Node] | None:
        """Two axes of independent computations in one kernel that line up: a rotary embedding applied to
        the queries (batch, heads) and to a key broadcast over its own (batch, heads), sharing only the
        positions and frequencies. Each output left off the other's axes would be written again at every
        step of them, not consecutively (wrong when the grid is split over cores), and each side's axes
        multiply the grid. Two classes are one axis when their extents agree in every traced configuration,
        no value spans both (the argument of `_share_dead_axes`: nothing combines them positionally) and
        each is the other's only such match; an ambiguous match is left alone."""

        def matches(c: Node) -> list[Node]:
            return [
                o
                for o in classes
                if o is not c
                and o not in reduced
                and ax.extents_all(o) == ax.extents_all(c)
                and not any(c in fp and o in fp for fp in footprints)
            ]

        for a in classes:
            if a in reduced or max(ax.extents_all(a)) <= 1:
                continue
            found = matches(a)
            if len(found) == 1 and matches(found[0]) == [a]:
                return a, found[0]
        return None

    def _long_sublanes(self, tile: list[list[Node]], io: list[Any]) -> list[list[Node]]:
        """Move a long tile group into the sublane position (second to last) when the group there is
        shorter than a sublane tile (8), as long as no operand or result needs a transpose for it.

        A short group there (the k of top-k, a few heads) leaves the operands that do not span it with a
        size-1 sublane dim: one row per vreg. Moving it ahead puts it on a leading dim, where each of its
        entries is a slab of whole (rows, lanes) tiles and a reduction over it is a chain of vreg adds."""
        ax = self.ax
        if len(tile) < 3:
            return tile
        ext = lambda grp: math.prod(ax.extent(c) for c in grp)  # noqa: E731
        if ext(tile[-2]) >= 8:
            return tile

        def io_bytes(grp: list[Node]) -> int:
            return sum(nbytes(v) for v in io if any(c in ax.footprint(v) for c in grp))

        candidates = [k for k in range(len(tile) - 2) if ext(tile[k]) >= 8]
        if not candidates:
            return tile
        best = max(candidates, key=lambda k: (io_bytes(tile[k]), ext(tile[k])))
        new = [grp for k, grp in enumerate(tile) if k != best]
        new.insert(len(new) - 1, tile[best])

        def order(t: list[list[Node]], v: Any) -> list[Node]:
            fp = ax.footprint(v)
            return [c for grp in t for c in grp if c in fp]

        if any(order(new, v) != order(tile, v) for v in io):
            return tile
        return new

    def _lane_dense(self, tile: list[list[Node]], reduced: set[Node]) -> list[list[Node]]:
        """Swap a short reduced lane group (< 128, the 64 experts of a router) with a long row group
        (>= 128 tokens) in a top-k region, so tokens fill the lanes and the experts the sublanes.

        Top-k runs k rounds of (max, first argmax, knock-out) over the reduced axis: with 64 experts on
        the lanes every op fills half of each vreg, and every per-token column it makes ((rows, 1): the
        winner, its index, the k gate weights) one lane in 128. Lane-dense, the same ops fill whole vregs
        and a column is one sublane row in 8: about a third of the VPU work per the block model
        (top-k gating 32768 x 64, k = 6: 182 -> 57 us on v5e). The operands are transposed outside for
        it (one more pass over them in HBM), which only a k-round loop repays: other reductions touch
        each element a few times and are bound by HBM, so they keep their layout."""
        ax = self.ax
        if len(tile) < 2 or not any(self.g.eqns[i].primitive.name == "top_k" for i in self.region.eqns()):
            return tile
        ext = lambda grp: math.prod(ax.extent(c) for c in grp)  # noqa: E731
        lane, row = tile[-1], tile[-2]
        if lane[0] in reduced and row[0] not in reduced and ext(lane) < 128 and ext(row) >= 128:
            return [*tile[:-2], lane, row]
        return tile

    def _small_tile(self, tile: list[list[Node]], io: list[Any]) -> bool:
        """Is one (rows, lanes) tile of the largest operand well under a pipelined DMA's sweet spot?

        The groups ahead of the tile are walked one element per grid step. When the trailing axes are
        short (80 heads x 64 head dims of a [2, 4096, 80, 64] map), that is thousands of steps of a few
        KiB each, and the ~0.35 us per step dwarfs the copy (8192 steps: 2.2 ms of overhead per map on a
        0.46 ms pass over HBM, per the block model). The innermost walked group then becomes a leading
        block dim, so a step moves whole slabs of tiles."""
        ax = self.ax
        lanes = -(-math.prod(ax.extent(c) for c in tile[-1]) // 128) * 128
        rows = math.prod(ax.extent(c) for grp in tile[:-1] for c in grp)
        itemsize = max((nbytes(v) // max(nelems(v), 1) for v in io), default=4)
        return rows * lanes * itemsize < SMALL_TILE_BYTES

    def _rows_and_lanes(self, group: list[Node]) -> list[list[Node]]:
        """Split one merged group of axes (every operand spans all of them alike) into rows and lanes.

        Kept whole, the group is flattened to a (1, n) array: each block fills one sublane of the eight a
        vreg has, and the grid walks n / BLOCK_COLS steps (a [4096, 1024] map took 4096 steps, 0.06x of
        XLA per the block model). The lanes take the shortest trailing run of axes that is at least a lane
        wide (128), the rows the rest, so blocks are (rows, lanes) tiles that fill whole vregs."""
        ax = self.ax
        for k in range(len(group) - 1, 0, -1):
            if math.prod(ax.extent(c) for c in group[k:]) >= 128:
                return [group[:k], group[k:]]
        return [group]

    def _widen_lanes(self, groups: list[list[Node]], io: list[Any]) -> list[list[Node]]:
        """Merge trailing groups into the lane dim while it is short (< 512) and the operands that vary
        along only part of it are small enough to broadcast outside (a quarter of the largest operand)."""
        ax = self.ax
        biggest = max((nelems(v) for v in io), default=1)
        groups = [list(g) for g in groups]
        while len(groups) >= 3 or (len(groups) == 2 and False):
            lane = groups[-1]
            if math.prod(ax.extent(c) for c in lane) >= 512:
                break
            merged = groups[-2] + lane
            ok = True
            for v in io:
                fp = ax.footprint(v)
                inter = [c for c in merged if c in fp]
                if inter and len(inter) < len(merged):
                    other = math.prod(ax.extent(c) for c in fp if c not in merged)
                    if other * math.prod(ax.extent(c) for c in merged) > biggest // 4:
                        ok = False
            if not ok:
                break
            groups = groups[:-2] + [merged]
        return groups

    def out_space(self) -> Space:
        return self.space

    def overhang_ok(self, d: SpaceDim) -> bool:
        # tiled dims are independent rows/columns (garbage past the edge stays in rows nobody keeps); the
        # walked reduction axis is masked with `valid`
        return d.role in ("tiled", "seq")

    def scratch(self) -> list[tuple[str, str, list[SpaceDim | str]]]:
        if not getattr(self, "stream", False):
            return []
        return self.stream_scratch(self.space, "acc")

    def make_body(self) -> list[str]:
        names = ["out"] if len(self.outputs) == 1 else [f"out{i}" for i in range(len(self.outputs))]
        scope = Scope(lines=[], indent="    ")
        if not self.stream:
            for v, nm in zip(self.outputs, names, strict=True):
                self.store(v, f"{nm}_ref", self.space, scope)
            return scope.lines
        red = next(d for d in self.dims if d.role == "seq")
        return self.streamed_body(scope, self.space, red, names, "acc")

    def title(self) -> str:
        red = any(self.g.kind[i] == "reduce" for i in self.region.eqns())
        ops = op_summary(self.g, self.region)
        return ("row-wise " if red else "elementwise ") + ops

    def structure(self) -> str:
        if self.family == "elementwise":
            return (
                "one grid step per (rows, cols) tile of the output; every elementwise op of the chain runs on "
                "the tile in VMEM, so each input is read once and each output written once"
            )
        if self.family == "reduction":
            online = (
                " (a max and a sum of exp(x - max) kept online: the sum is rescaled whenever the running max grows)"
                if online_sums(self.g, self.region.eqns())
                else ""
            )
            return (
                "the reduced axis is walked in blocks (innermost, sequential) with f32 accumulators in VMEM"
                f"{online}; the finishing ops run once per row block at the last step, so the input is read "
                "once"
            )
        return (
            "one grid step per block of rows; each row's reduced axis is whole in the block, so the "
            "reductions and everything around them run in VMEM in a single pass over HBM"
        )

    def param_doc(self, d: SpaceDim) -> str:
        return {
            "rows": "rows per grid step",
            "cols": "columns (lanes) per grid step",
            "red": "elements of the reduced axis per grid step (the sequential axis)",
        }.get(d.key, "block of a leading axis per grid step")

    def flops(self) -> float:
        n = 0.0
        for i in self.region.eqns():
            if self.g.kind[i] in ("elementwise", "reduce"):
                n += max(
                    nelems(v) for v in (*self.g.eqns[i].invars, *self.g.eqns[i].outvars) if not is_literal(v)
                )
        return n

    def temporaries(self) -> list[BufferSpec]:
        n_ops = sum(1 for i in self.region.eqns() if self.g.kind[i] in ("elementwise", "reduce"))
        live = min(max(2, n_ops // 3), 6)
        return [
            BufferSpec(
                what=f"~{live} f32 tiles of intermediates",
                dims=self.tile_refs(self.space),
                itemsize=4,
                copies=live,
                kind="temporary",
            )
        ]
