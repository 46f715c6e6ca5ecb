"""Paged K/V operands: an attention kernel that fetches each page straight from the page pool.

A paged-attention reference gathers every sequence's pages out of a shared pool (`k_pages[page_table]`,
then a reshape that merges the page axis with the in-page positions) before any arithmetic. Left as XLA
glue, that gather writes a full copy of every sequence's cache to HBM and the kernel reads it back, after a
transpose into its own layout (two more passes): at decode, where the kernel itself only streams the
cache once, the glue costs about four times the kernel (paged decode, v5e, per the block model: 2.9 ms of
glue around a 0.7 ms kernel).

Here the kernel reads the pool itself. The page table goes to SMEM by scalar prefetch; a key block of
`bkv` keys is `bkv / page` pages, each its own pipelined operand whose index map reads its page id from the
table, so the pipeline copies each page (all its heads: one contiguous DMA) from the pool into VMEM, and a
block past a sequence's length keeps the page index of the last live block (no new copy). The heads a page
holds are walked inside the kernel, one online-softmax state per head: a page fetched per head would be
read once per head.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from maxkernel.authors.offline.dataflow import Graph, is_literal
from maxkernel.authors.offline.emit import dtype_name
from maxkernel.authors.offline.kernels import Layout, LowerError, Scope, Space, SpaceDim, StepSchedule


@dataclass(frozen=True, eq=False)
class PagedOperand:
    """A region input that is a merge-reshape of a whole-page gather out of a pool.

    var: [*lead, pages * page, *rest] (what the region reads); pool: [n_pages, page, *rest];
    table: the gather's indices, [*lead, pages, 1]; `lead` dims come before the merged key axis."""

    var: Any
    pool: Any
    table: Any
    lead: int

    @property
    def page(self) -> int:
        return int(self.pool.aval.shape[1])


MAX_PAGES_PER_BLOCK = 32
"""Most pages (each its own operand, DMA and unrolled copy in the kernel) per key block: Mosaic's compile
time grows with them (64 pages of paged decode: ~20 s per TPU generation under load, 32: about half), and
beyond 32 pages of 16 keys the per-step overhead is already a small share of a block's copy."""

PAGED_MODES = ("PROMISE_IN_BOUNDS", "CLIP")
"""Gather modes whose out-of-range ids may be clipped into the pool (the kernel's index maps must never
point a DMA outside it). FILL_OR_DROP (a zero page) has no such reading and is left as glue."""


def find_paged(g: Graph, status: list[str], var: Any) -> PagedOperand | None:
    """`var` as a paged operand when XLA glue produces it as `reshape(gather(pool, table))`: the gather
    takes whole pages along the pool's first axis (`pool[table]`), and the reshape only merges the page
    axis with the in-page axis after it."""
    if is_literal(var):
        return None
    p = g.producer.get(var)
    if p is None or status[p] != "glue" or g.eqns[p].primitive.name != "reshape":
        return None
    gathered = g.eqns[p].invars[0]
    q = g.producer.get(gathered)
    if is_literal(gathered) or q is None or status[q] != "glue" or g.eqns[q].primitive.name != "gather":
        return None
    e = g.eqns[q]
    pool, table = e.invars[0], e.invars[1]
    if is_literal(pool) or is_literal(table):
        return None
    dn = e.params["dimension_numbers"]
    mode = getattr(e.params.get("mode"), "name", str(e.params.get("mode")))
    ps, ts, gs, vs = (tuple(int(d) for d in x.aval.shape) for x in (pool, table, gathered, var))
    if (
        len(ps) < 3
        or len(ts) < 2
        or ts[-1] != 1
        or tuple(dn.collapsed_slice_dims) != (0,)
        or tuple(dn.start_index_map) != (0,)
        or tuple(getattr(dn, "operand_batching_dims", ())) != ()
        or tuple(getattr(dn, "start_indices_batching_dims", ())) != ()
        or tuple(dn.offset_dims) != tuple(range(len(ts) - 1, len(ts) - 1 + len(ps) - 1))
        or tuple(int(s) for s in e.params["slice_sizes"]) != (1, *ps[1:])
        or mode not in PAGED_MODES
        or not str(table.aval.dtype).startswith("int")
    ):
        return None
    lead = len(ts) - 2
    if gs != (*ts[:-1], *ps[1:]) or vs != (*gs[:lead], gs[lead] * gs[lead + 1], *gs[lead + 2 :]):
        return None
    return PagedOperand(var=var, pool=pool, table=table, lead=lead)


class PagedAttention:
    """What a flash-attention builder adds to read paged K/V from the pool (mixed into `AttentionBuilder`).

    `plan_paged` picks the operands after the space is made; the overrides below then load a key block as
    the concatenation of its pages (one head's rows of each), give each page its own block spec and index
    map, pass the pool and the page table to the wrapper instead of the gathered copy, and walk the heads
    of a page inside the kernel (`whole_grid`): the head axis keeps its place in every view and index map,
    with a grid extent of 1, so each block that spans it holds all heads and `.at[head]` is one head's.
    """

    paged: dict[Any, PagedOperand]
    page_heads: SpaceDim | None

    def plan_paged(self: Any) -> None:
        self.paged, self.page_heads = {}, None
        if not self.low.options.paged:
            return
        found: dict[Any, tuple[PagedOperand, SpaceDim | None]] = {}
        for v in self.inputs:
            pg = find_paged(self.g, self.part.status, v)
            if pg is None:
                continue
            dims = []
            for c in self.ax.classes(v):
                try:
                    dims.append(None if c is None else self.class_dim(c))
                except LowerError:
                    dims = []
                    break
            if not dims or dims[pg.lead] is not self.kv or len(self.kv.classes) != 1:
                continue
            if any(d is not None and (d.role != "grid" or d.axis is None) for d in dims[: pg.lead]):
                continue
            rest = dims[pg.lead + 1 :]
            heads = [d for d in rest if d is not None and d.role == "grid"]
            inner = [d for d in rest if d is not None and d.role != "grid"]
            if None in rest or len(heads) > 1 or len(inner) != 1 or rest[-1] is not inner[0]:
                continue
            if heads and (heads[0].axis is None or len(heads[0].classes) != 1):
                continue
            found[v] = (pg, heads[0] if heads else None)
        if not found:
            return
        heads = {id(h) for _, h in found.values()}
        # one page size in every traced configuration: the number of page operands per key block follows
        # from it, and the program must be the same at every shape
        pages = {int(s[1]) for pg, _ in found.values() for s in self.low.traces.shapes(pg.pool)}
        if len(heads) != 1 or len(pages) != 1:
            return
        self.paged = {v: pg for v, (pg, _) in found.items()}
        self.page_heads = next(iter(found.values()))[1]
        if self.page_heads is not None:
            self.whole_grid.add(self.page_heads.key)
            self.kw(self.page_heads.ext, self.page_heads.ext)
        self.notes.append(
            "paged K/V read straight from the page pool: the page table is scalar-prefetched and each page of "
            "a key block is its own pipelined operand whose index map reads the page id (no gathered copy in "
            "HBM); the heads of a page are walked inside the kernel, so a page is fetched once for all of them"
        )

    def page_rest(self: Any, pg: PagedOperand) -> list[SpaceDim]:
        return [self.class_dim(c) for c in self.ax.classes(pg.var)[pg.lead + 1 :]]

    def load_paged(self: Any, var: Any, space: Space, scope: Scope) -> tuple[str, frozenset[str]]:
        """A key block of a paged operand: one head's rows of each of its pages, stacked along the keys."""
        pg = self.paged[var]
        rest = self.page_rest(pg)
        inner = [d for d in rest if d.role != "grid"]
        if [d.key for d in space.dims] != [self.kv.key, inner[0].key]:
            raise LowerError("a paged operand read in another layout than (keys, features)")
        self.input_view[var] = [*self.grid_dims(), *space.dims]
        self.kv.sublane_use = True
        inner[0].lane_use = True
        for d in space.dims:
            d.min_itemsize = min(d.min_itemsize, var.aval.dtype.itemsize)
        self.kw("pages_per_block", "pages_per_block")
        index = ", ".join([":", *("head" if d.role == "grid" else ":" for d in rest)])
        name = self.fresh(f"{self.local(var)}_blk")
        mat = frozenset(d.key for d in space.dims)
        scope.add(
            f"{name} = jnp.concatenate([page_ref[{index}] for page_ref in {self.local(var)}_pages], axis=0)"
            + self.comment(dtype_name(var.aval), space, mat)
        )
        return name, mat

    def paged_schedule(self: Any) -> None:
        """Put the page tables among the scalar-prefetch operands (with a plain grid if none was planned);
        the head axis, walked in the kernel, gets a grid extent of 1."""
        grid_axes = sorted({d.axis for d in self.dims if d.axis is not None})
        if self.schedule is None:
            dims = {d.axis: d for d in self.dims if d.axis is not None}
            self.schedule = StepSchedule(
                prefetch=[],
                grid=[
                    (
                        dims[a].key,
                        f"{dims[a].padded} // {dims[a].blk}"
                        if dims[a].role in ("tiled", "seq")
                        else dims[a].ext,
                        "arbitrary" if dims[a].role == "seq" else "parallel",
                    )
                    for a in grid_axes
                ],
                axis_code={},
            )
        elif any(name not in {d.key for d in self.dims} for name, _, _ in self.schedule.grid):
            raise LowerError("paged K/V with a grid that walks a table of live blocks")
        self.schedule.grid = [(k, "1" if k in self.whole_grid else e, s) for k, e, s in self.schedule.grid]
        self.schedule.prefetch += [f"{self.local(v)}_table" for v in self.paged]

    def axis_expr(self: Any, d: SpaceDim | None) -> str:
        """A grid dim's block index as an index map computes it (data-driven where the schedule says)."""
        if d is None:
            return "0"
        code = self.schedule.axis_code if self.schedule is not None else {}
        return code[d.axis][1] if d.axis in code else f"{self.axis_name(d.axis)}_index"

    def page_index_maps(self: Any, index_args: str) -> tuple[list[str], dict[str, str]]:
        code, map_of = [], {}
        for v, pg in self.paged.items():
            nm = self.local(v)
            lead = [None if c is None else self.class_dim(c) for c in self.ax.classes(v)[: pg.lead]]
            row = ", ".join(
                [*(self.axis_expr(d) for d in lead), f"{self.axis_expr(self.kv)} * pages_per_block + slot"]
            )
            zeros = ", ".join(["0"] * (len(pg.pool.aval.shape) - 1))
            fname = f"{self.stem}_{nm}_page_index_map"
            code.append(
                f"def {fname}({index_args}, *, slot, pages_per_block):\n"
                f"    # page `slot` of the key block: its id from the table (past a length, the last live block's)\n"
                f"    return ({nm}_table_ref[{row}], {zeros})\n"
            )
            map_of[nm] = fname
        return code, map_of

    def paged_kernel_function(self: Any, lay: Layout, body: list[str]) -> str:
        """The kernel with the page refs unpacked and, with a head axis, the body run once per head on that
        head's views of the refs that hold all heads."""
        sched = self.schedule
        head = self.page_heads
        kw = sorted(self.kernel_kw)
        refs = [f"{n}_ref" for n in sched.prefetch]
        sig = ", ".join([*refs, "*refs", *kw])
        lines = [f"def {self.stem}_kernel({sig}):", f'    """{self.kernel_doc()}"""', "    refs = list(refs)"]
        per_head: list[str] = []
        for v, nm in zip(lay.in_vars, lay.names_in, strict=True):
            if v in self.paged:
                lines.append(f"    {nm}_pages = [refs.pop(0) for _ in range(pages_per_block)]")
            elif head is not None and self.spans(v, head):
                lines.append(f"    {nm}_heads_ref = refs.pop(0)")
                per_head.append(nm)
            else:
                lines.append(f"    {nm}_ref = refs.pop(0)")
        for v, nm in zip(self.outputs, lay.out_names, strict=True):
            if head is not None and self.spans(v, head):
                lines.append(f"    {nm}_heads_ref = refs.pop(0)")
                per_head.append(nm)
            else:
                lines.append(f"    {nm}_ref = refs.pop(0)")
        for s in self.scratch():
            stem = s[0][: -len("_ref")]
            if head is not None:
                lines.append(f"    {stem}_heads_ref = refs.pop(0)")
                per_head.append(stem)
            else:
                lines.append(f"    {s[0]} = refs.pop(0)")
        for a in sorted(self.axis_used):
            if a in sched.axis_code:
                lines.append(f"    {self.axis_name(a)}_index = {sched.axis_code[a][0]}")
            else:
                lines.append(f"    {self.axis_name(a)}_index = pl.program_id({a})")
        if head is None:
            lines += body
        else:
            lines.append(
                f"    for head in range({head.ext}):  # the heads of a page, each its own softmax state"
            )
            lines += [f"        {n}_ref = {n}_heads_ref.at[head]" for n in per_head]
            lines += [("    " + line) if line.strip() else line for line in body]
        return "\n\n".join([*sched.defs, "\n".join(lines) + "\n"])

    def paged_extent_lines(self: Any, lines: list[str]) -> list[str]:
        """Extents read off a paged operand come from its pool and table (the wrapper never sees the copy)."""
        for v, pg in self.paged.items():
            nm = self.local(v)

            def shape(m: re.Match[str], nm: str = nm, lead: int = pg.lead) -> str:
                k = int(m.group(1))
                if k < lead:
                    return f"{nm}_table.shape[{k}]"
                if k == lead:
                    return f"{nm}_table.shape[{k}] * {nm}.shape[1]"
                return f"{nm}.shape[{k - lead + 1}]"

            lines = [re.sub(rf"\b{nm}\.shape\[(\d+)\]", shape, line) for line in lines]
        return lines

    def paged_block_lines(self: Any) -> list[str]:
        nm = self.local(next(iter(self.paged)))
        kv = self.kv
        # pages per key block from the tuned block alone (not from the sequence length): the number of page
        # operands, so the program, is the same at every shape; a short table is padded to a whole block
        return [
            f"page = {nm}.shape[1]  # keys per page",
            f"pages_per_block = max(1, min({MAX_PAGES_PER_BLOCK}, {kv.param} // page))",
            f"{kv.blk} = page * pages_per_block  # whole pages per key block",
            f"{kv.padded} = _round_up({kv.ext}, {kv.blk})",
        ]

    def paged_operand_lines(self: Any, var: Any, nm: str) -> list[str]:
        pg = self.paged[var]
        pages = f"{self.kv.padded} // page"
        return [
            f"# page ids, kept inside the pool ({pg.pool.aval.str_short()} as the reference names it), padded to whole key blocks",
            f"{nm}_table = jnp.clip({nm}_table.reshape({nm}_table.shape[:-1]).astype(jnp.int32), 0, {nm}.shape[0] - 1)",
            f"{nm}_table = _pad_to({nm}_table, (*{nm}_table.shape[:-1], {pages}))",
        ]

    def paged_spec(self: Any, nm: str, map_of: dict[str, str]) -> str:
        return (
            f"*[pl.BlockSpec((None, *{nm}.shape[1:]), functools.partial({map_of[nm]}, slot=i, "
            f"pages_per_block=pages_per_block)) for i in range(pages_per_block)]"
        )

    # --- the Builder hooks, paged where a paged operand is involved ------------------------------------
    def load(self: Any, var: Any, space: Space, scope: Scope) -> tuple[str, frozenset[str]]:
        if var in self.paged:
            return self.load_paged(var, space, scope)
        return super().load(var, space, scope)  # type: ignore[misc]

    def assemble(self: Any, body: list[str]) -> Any:
        if self.paged:
            self.paged_schedule()
        return super().assemble(body)  # type: ignore[misc]

    def emit_index_maps(self: Any, lay: Layout) -> tuple[list[str], dict[str, str]]:
        if not self.paged:
            return super().emit_index_maps(lay)  # type: ignore[misc]
        keep = [k for k, v in enumerate(lay.in_vars) if v not in self.paged]
        plain = replace(lay, in_vars=[lay.in_vars[k] for k in keep], names_in=[lay.names_in[k] for k in keep])
        code, map_of = super().emit_index_maps(plain)  # type: ignore[misc]
        pcode, pmap = self.page_index_maps(lay.index_args)
        return [*code, *pcode], {**map_of, **pmap}

    def emit_kernel_function(self: Any, lay: Layout, body: list[str]) -> str:
        if not self.paged:
            return super().emit_kernel_function(lay, body)  # type: ignore[misc]
        return self.paged_kernel_function(lay, body)

    def extent_lines(self: Any, in_vars: list[Any]) -> list[str]:
        return self.paged_extent_lines(super().extent_lines(in_vars))  # type: ignore[misc]

    def block_size_lines(self: Any) -> list[str]:
        return self.paged_block_lines() if self.paged else []

    def operand_lines(self: Any, var: Any, name: str) -> list[str] | None:
        return self.paged_operand_lines(var, name) if var in self.paged else None

    def operand_spec(self: Any, var: Any, name: str, map_of: dict[str, str]) -> str | None:
        return self.paged_spec(name, map_of) if var in self.paged else None

    def paged_names(self: Any) -> set[str]:
        return {self.local(v) for v in self.paged}

    def wrapper_params(self: Any, names_in: list[str]) -> list[str]:
        paged = self.paged_names()
        return [p for n in names_in for p in ([n, f"{n}_table"] if n in paged else [n])]

    def call_args(self: Any, names_in: list[str]) -> list[str]:
        paged = self.paged_names()
        return [f"*[{n}] * pages_per_block" if n in paged else n for n in names_in]

    def bytes_code(self: Any, names_in: list[str], one: bool) -> str:
        """A paged operand moves the pages its table lists (at most), not the whole pool."""
        paged = self.paged_names()
        plain = [n for n in names_in if n not in paged]
        code = super().bytes_code(plain, one)  # type: ignore[misc]
        for n in sorted(paged):
            code += f" + {n}_table.size * math.prod({n}.shape[1:]) * {n}.dtype.itemsize"
        return code

    def call_expression(self: Any, lay: Layout) -> str:
        if not self.paged:
            return super().call_expression(lay)  # type: ignore[misc]
        args = []
        for v in lay.in_vars:
            pg = self.paged.get(v)
            args += [self.low.name_of(pg.pool), self.low.name_of(pg.table)] if pg else [self.low.name_of(v)]
        args += [f"{k}={self.call_kw[k]}" for k in sorted(self.call_kw)]
        return f"{self.stem}({', '.join(args)})"
