"""Cut the flat jaxpr into kernels ("regions") and the plain-XLA layout glue between them.

Every equation gets a status:

* **glue**: a real layout op (split/merge reshape, slice, pad, concatenate, gather), or an absorbed op on
  inputs whose result a glue op needs. Runs outside `pallas_call`.
* **float**: elementwise/absorbed work on values available outside any kernel (inputs, glue results,
  iotas): a mask built from `arange`, a `.astype` of an input. Floats belong to no kernel in particular;
  every kernel that uses one recomputes it on its own blocks, which costs no HBM traffic.
* **owned**: everything else belongs to exactly one region.

Regions grow greedily in program order. A `dot_general` starts a matmul region, or an attention region
when the flash-attention pattern follows it; a reduction joins its producer's region when the template
allows it (a matmul epilogue may reduce along its output rows: whole in a tile, or walked in N blocks with
online accumulators when they are long), or a row-wise region that already reads the same input (a sibling
reduction), and otherwise starts a row-wise region; elementwise work joins the region of its operands.
Two matmul regions whose results are combined elementwise merge into one kernel with two accumulators
(SwiGLU). Whatever cannot join is cut: the value is written to HBM by one kernel and read by the next.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from maxkernel.authors.offline.axes import Axes, Conflict, Node
from maxkernel.authors.offline.conv_epilogue import epilogue_ok as conv_epilogue_ok
from maxkernel.authors.offline.conv_pool import absorb_pools
from maxkernel.authors.offline.dataflow import Graph, is_literal, reduced_axes
from maxkernel.authors.offline.families import FAMILY_OF, families_starting
from maxkernel.authors.offline.online import online_sums

STREAM_ELEMS = 64 * 1024
"""Reduced extents above this (at the task's own shapes) are walked in blocks instead of held whole."""


COLUMN_WHOLE_ELEMS = 8192
"""A reduction along a matmul's rows (M) over more rows than this is accumulated in the matmul kernel's
epilogue, M walked sequentially, even when the matmul's output is also read afterwards (a batch norm: the
one-pass moments make both statistics column sums of the product, moments.py); a row-wise kernel holding
whole columns would need (M, 128) f32 blocks and their temporaries in VMEM (~80 MiB at 16384 rows)."""

TINY_GLUE_ELEMS = 1 << 16
"""Elementwise work feeding only layout ops (index arithmetic before a gather) stays outside kernels when
it is this small and under 1% of the largest input."""

MATMUL_ROW_ELEMS = 16 * 1024
"""A matmul epilogue keeps N whole (one (bm, N) f32 tile) only up to this; a longer N is walked in blocks
as a sequential grid axis, its reductions kept online (a cross-entropy over a large vocabulary)."""


@dataclass
class Options:
    """Fusion switches; the repair path turns them off one by one when a fused kernel fails."""

    attention: bool = True
    multi_dot: bool = True
    epilogue_reductions: bool = True
    paged: bool = True  # attention reads paged K/V straight from the pool (paged.py)


FUSION_LEVELS: tuple[Options, ...] = (
    Options(),
    Options(attention=True, multi_dot=True, epilogue_reductions=False, paged=False),
    Options(attention=True, multi_dot=False, epilogue_reductions=False, paged=False),
    Options(attention=False, multi_dot=False, epilogue_reductions=False, paged=False),
)
"""From most to least fused; analysis falls down this ladder when a fused region does not fit."""


@dataclass
class AttentionInfo:
    score_dots: list[int]
    pv_dot: int
    softmax: bool
    row_max: Any | None = None  # var: the reference's row max (m)
    row_sum: Any | None = None  # var: the reference's row sum (l)
    normalised_before_pv: bool = False
    logits: Any | None = None  # var G fed to the row max (or to exp)
    probs: Any | None = None  # var fed to the pv dot (lhs)
    kv_class: Node | None = None
    probs_side: int = 0  # which operand of the pv dot holds the probabilities
    # a row-sum normalisation without a max (retention): probs = num / den(l), l = sum(f(num)) over the keys;
    # the kernel accumulates num @ v and l, and divides by den(l) once at the end
    row_norm: bool = False
    norm_num: Any | None = None  # var: the numerator (the unnormalised scores)
    norm_den: Any | None = None  # var: the divisor, an elementwise function of l alone
    norm_div: Any | None = None  # var: num / den
    sum_operand: Any | None = None  # var: what the row sum adds up


@dataclass
class Region:
    id: int
    kind: str  # a key of families.FAMILY_OF
    axes: Axes
    owned: list[int] = field(default_factory=list)
    pulled: set[int] = field(default_factory=set)
    dots: list[int] = field(default_factory=list)
    has_reduction: bool = False
    attention: AttentionInfo | None = None
    stream: bool = False  # a map region whose reduced axis is too long for one block: walked in blocks

    def eqns(self) -> list[int]:
        return sorted(set(self.owned) | self.pulled)


def _widening_float(src: Any, out: Any) -> bool:
    a, b = np.dtype(src.aval.dtype), np.dtype(out.aval.dtype)
    floats = all(np.issubdtype(d, np.floating) or d.name == "bfloat16" for d in (a, b))
    return floats and b.itemsize > a.itemsize


def _elems(v: Any) -> int:
    n = 1
    for d in getattr(v.aval, "shape", ()):
        n *= int(d)
    return n


class Partition:
    def __init__(self, graph: Graph, options: Options | None = None) -> None:
        self.g = graph
        self.opt = options or Options()
        self.status: list[str] = [""] * len(graph.eqns)
        self.regions: dict[int, Region] = {}
        self.owner: dict[int, int] = {}  # eqn -> region id
        self._next = 0
        self._classify()
        self._online = online_sums(graph, [i for i, st in enumerate(self.status) if st == "owned"])

    # --- statuses -------------------------------------------------------------------------------------
    def _classify(self) -> None:
        g = self.g
        outside: set[Any] = set(g.invars) | set(g.constvars)  # values available without a kernel
        random: set[Any] = set()  # values derived only from random bits (a dropout mask)
        const: set[Any] = set()  # values derived only from literals
        for i, e in enumerate(g.eqns):
            kind = g.kind[i]
            ins = [v for v in e.invars if not is_literal(v)]
            avail = all(v in outside for v in ins)
            if (
                kind in ("elementwise", "absorbed")
                and all(v in const for v in ins)
                and e.primitive.name != "iota"
            ):
                const.update(e.outvars)
            if kind == "random" or (
                kind in ("elementwise", "absorbed")
                and avail
                and any(v in random for v in ins)
                and all(v in random or v in const for v in ins)
            ):
                self.status[i] = "glue"
                outside.update(e.outvars)
                random.update(e.outvars)
            elif kind == "glue":
                self.status[i] = "glue"
                outside.update(e.outvars)
            elif kind in ("elementwise", "absorbed") and avail:
                self.status[i] = "float"
                outside.update(e.outvars)
            else:
                self.status[i] = "owned"
        # An absorbed float whose result a glue op (or the program's output) needs runs as glue; walking
        # backwards lets a chain of them (broadcast of a convert of an input) all become glue.
        self.const = const
        self.dual: set[int] = set()  # glue equations kernels may also recompute (casts of inputs)
        for i in range(len(g.eqns) - 1, -1, -1):
            if self.status[i] != "float":
                continue
            e = g.eqns[i]
            literal_only = (
                all(v in const for v in e.invars if not is_literal(v)) and e.primitive.name != "iota"
            )
            if g.kind[i] != "absorbed" and not literal_only:
                continue
            # its inputs: glue values, or a chain of absorbed floats over them (an expand-dims before the
            # broadcast of `jnp.repeat`), which become glue with it
            chain = [q for q in self.float_closure(e.outvars[0]) if q != i]
            layout = self._layout_only(chain)
            if not layout and not literal_only:
                continue
            cons = [c for v in e.outvars for c in g.consumers.get(v, [])]
            if any(self.status[c] == "glue" for c in cons) or any(v in g.out_set for v in e.outvars):
                for q in [i, *chain] if layout else [i]:
                    if self.status[q] != "float":
                        continue
                    self.status[q] = "glue"
                    qcons = [c for v in g.eqns[q].outvars for c in g.consumers.get(v, [])]
                    if g.kind[q] == "absorbed" and any(self.status[c] != "glue" for c in qcons):
                        # kernels recompute it from its (smaller) source instead of reading XLA's copy
                        self.dual.add(q)

        self._views_as_glue()

    def _views_as_glue(self) -> None:
        """An input or glue value that floats reshape into two different unit-dim placements (`c[:, None]` and
        `c[None, :]` of an outer difference `c_i - c_j`) would tie its one axis to two axes of the kernel that
        combines them, which no iteration space holds. Each such view runs as glue instead: XLA writes a copy
        the size of the value (a [.., S] vector as [.., S, 1] and [.., 1, S]) and the kernel reads the two
        views as two operands, one along each axis."""
        g = self.g
        views: dict[Any, dict[tuple[Any, ...], list[int]]] = {}
        for i, e in enumerate(g.eqns):
            if self.status[i] != "float" or e.primitive.name not in (
                "broadcast_in_dim",
                "reshape",
                "expand_dims",
            ):
                continue
            src = e.invars[0]
            if is_literal(src) or src in self.const:
                continue
            p = g.producer.get(src)
            if p is not None and self.status[p] != "glue":
                continue
            out = e.outvars[0]
            if math.prod(out.aval.shape) != math.prod(src.aval.shape) or out.aval.ndim <= src.aval.ndim:
                continue
            views.setdefault(src, {}).setdefault(tuple(out.aval.shape), []).append(i)
        for by_shape in views.values():
            if len(by_shape) < 2:
                continue
            for eqns in by_shape.values():
                for i in eqns:
                    self.status[i] = "glue"
                    self.dual.discard(i)

    # --- helpers --------------------------------------------------------------------------------------
    def _layout_only(self, eqns: list[int]) -> bool:
        """Equations that only move data (absorbed layout ops; an iota makes values, so it is not one)."""
        return all(self.g.kind[q] == "absorbed" and self.g.eqns[q].primitive.name != "iota" for q in eqns)

    def float_closure(self, var: Any) -> list[int]:
        """The float equations `var` needs, in program order (empty for inputs and glue values)."""
        out: set[int] = set()
        stack = [var]
        while stack:
            v = stack.pop()
            if is_literal(v):
                continue
            p = self.g.producer.get(v)
            if p is None or (self.status[p] != "float" and p not in self.dual) or p in out:
                continue
            out.add(p)
            stack.extend(self.g.eqns[p].invars)
        return sorted(out)

    def _depends_on(self, var: Any, region: Region, extra: set[int]) -> bool:
        """Does `var` (outside the region) depend on anything the region owns?"""
        owned = set(region.owned)
        seen: set[int] = set()
        stack = [var]
        while stack:
            v = stack.pop()
            if is_literal(v):
                continue
            p = self.g.producer.get(v)
            if p is None or p in seen:
                continue
            if p in owned:
                return True
            seen.add(p)
            if p in extra:
                continue
            stack.extend(self.g.eqns[p].invars)
        return False

    def produced_in(self, region: Region) -> set[Any]:
        return {v for i in region.eqns() for v in self.g.eqns[i].outvars}

    def _external_inputs(self, region: Region, eqns: list[int]) -> list[Any]:
        produced = self.produced_in(region) | {v for i in eqns for v in self.g.eqns[i].outvars}
        ext = []
        for i in eqns:
            for v in self.g.eqns[i].invars:
                if not is_literal(v) and v not in produced:
                    ext.append(v)
        return ext

    def new_region(self, kind: str) -> Region:
        r = Region(id=self._next, kind=kind, axes=Axes(self.g))
        self._next += 1
        self.regions[r.id] = r
        return r

    def prepare(self, region: Region, i: int) -> tuple[Axes, list[int]] | None:
        """Axes and floats to pull if owned equation `i` can join the region (its template still holds)."""
        e = self.g.eqns[i]
        pulls: list[int] = []
        for v in e.invars:
            for p in self.float_closure(v):
                if p not in region.pulled and p not in region.owned and p not in pulls:
                    pulls.append(p)
        pulls.sort()
        new = [*pulls, i]
        ext = self._external_inputs(region, new)
        if any(self._depends_on(v, region, set()) for v in ext):
            return None
        ax = region.axes.copy()
        try:
            for j in new:
                ax.add(self.g.eqns[j])
        except Conflict:
            return None
        if not self._template_ok(region, ax, i):
            return None
        return ax, pulls

    def commit(self, region: Region, i: int, ax: Axes, pulls: list[int]) -> None:
        region.axes = ax
        region.pulled.update(pulls)
        region.owned.append(i)
        self.owner[i] = region.id
        if self.g.kind[i] == "reduce":
            region.has_reduction = True
            e = self.g.eqns[i]
            if self.reduced_extent(ax, e) > self._stream_threshold(region) or self._reduces_m(region, ax, e):
                region.stream = True

    @staticmethod
    def _stream_threshold(region: Region) -> int:
        """Reduced extents above this are walked in blocks: a map's row is read once either way, a matmul's
        (bm, N) f32 tile must fit VMEM next to its operand blocks."""
        return MATMUL_ROW_ELEMS if region.kind == "matmul" else STREAM_ELEMS

    def try_add(self, region: Region, i: int) -> bool:
        prepared = self.prepare(region, i)
        if prepared is None:
            return False
        self.commit(region, i, *prepared)
        return True

    def _template_ok(self, region: Region, ax: Axes, i: int) -> bool:
        e = self.g.eqns[i]
        kind = self.g.kind[i]
        if region.kind == "conv" and self.opt.epilogue_reductions:
            return conv_epilogue_ok(
                self, region, i, kind
            )  # bias, scale, activations, casts on its accumulator
        if FAMILY_OF[region.kind].fixed_template:  # only a cast of its result joins it
            return len(region.owned) == 1 and e.primitive.name == "convert_element_type"
        if region.kind == "map":
            if kind == "dot":
                return False
            return self._stream_ok(region, ax, i)
        if kind == "dot":
            return False
        out_classes = self._output_classes(region, ax)
        for v in e.outvars:
            if not ax.footprint(v) <= out_classes:
                return False
        for j in region.pulled | {i}:
            for v in self.g.eqns[j].outvars:
                if not ax.footprint(v) <= out_classes | ax.contracted_classes():
                    return False
        if kind == "reduce":
            if region.kind != "matmul" or not self.opt.epilogue_reductions:
                return False
            x = e.invars[0]
            red = {ax.cls(x, d) for d in reduced_axes(e)} - {None}
            n_classes = self._n_classes(region, ax)
            if (red != n_classes or not n_classes) and not (
                self._reduces_m(region, ax, e) and self._rows_used_once(region, ax)
            ):
                return False
            if e.primitive.name not in ("reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin"):
                return False
        if region.kind == "matmul" and (region.stream or kind == "reduce"):
            # a row longer than MATMUL_ROW_ELEMS: N becomes a sequential axis with online accumulators
            return self._stream_ok(region, ax, i)
        return True

    def reduced_extent(self, ax: Axes, e: Any) -> int:
        n = 1
        for a in reduced_axes(e):
            c = ax.cls(e.invars[0], a)
            if c is not None:
                n *= max(ax.extents_all(c))
        return n

    def _post_vars(self, region: Region, extra: list[int], online: set[int] | None = None) -> set[Any]:
        """Values computed from a reduction's result (in program order). The sub/exp/casts of an online
        sum (`online`, see online.py) are per-block values: they see the running max, not a finished one."""
        post: set[Any] = set()
        online = online or set()
        for j in sorted(set(region.eqns()) | set(extra)):
            e = self.g.eqns[j]
            ins = [v for v in e.invars if not is_literal(v)]
            if j in online:
                if any(v in post for v in (ins[:1] if e.primitive.name == "sub" else ins)):
                    post.update(e.outvars)
                continue
            if self.g.kind[j] == "reduce" or any(v in post for v in ins):
                post.update(e.outvars)
        return post

    def _stream_ok(self, region: Region, ax: Axes, i: int) -> bool:
        """A map region whose reduced axis is longer than STREAM_ELEMS is walked in blocks along that axis
        with accumulators, so nothing may combine a finished reduction with values along the axis, and
        every reduction must run along the same axes."""
        e = self.g.eqns[i]
        stream = region.stream
        if self.g.kind[i] == "reduce" and (
            self.reduced_extent(ax, e) > self._stream_threshold(region) or self._reduces_m(region, ax, e)
        ):
            stream = True
        if not stream:
            return self._whole_reductions_fit(region, ax, i)
        red = ax.reduced_classes()
        reds = [j for j in [*region.eqns(), i] if self.g.kind[j] == "reduce"]
        sets = {
            frozenset(ax.cls(self.g.eqns[j].invars[0], a) for a in reduced_axes(self.g.eqns[j])) - {None}
            for j in reds
        }
        if len(sets) > 1:
            return False
        if any(self.g.eqns[j].primitive.name not in ("reduce_sum", "reduce_max", "reduce_min") for j in reds):
            return False
        # sum(exp(a - max(a))) is rescaled online (online.py): its chain may use the running max per block
        chain = {q for o in self._online.values() for q in o.values}
        exempt = chain | {q for o in self._online.values() for q in o.layout}
        post = self._post_vars(region, [i], chain)
        for j in sorted(set(region.eqns()) | {i}):
            ej = self.g.eqns[j]
            ins = [v for v in ej.invars if not is_literal(v)]
            if j in exempt:
                if ej.primitive.name == "sub" and ins[0] in post:
                    return False  # `a` itself depends on a reduction: no single pass
                continue
            if self.g.kind[j] == "reduce":
                if any(v in post for v in ins):
                    return False
                continue
            if any(v in post for v in ins) and any(ax.footprint(v) & red for v in [*ins, *ej.outvars]):
                return False
        return True

    def _whole_reductions_fit(self, region: Region, ax: Axes, i: int) -> bool:
        """A map region that is not streamed holds every reduced axis whole in its block: reductions along
        different axes (a row sum over the vocabulary, then a mean over the tokens) share a region only
        while all their axes together fit one block."""
        reds = [j for j in [*region.eqns(), i] if self.g.kind[j] == "reduce"]
        sets = {
            frozenset(ax.cls(self.g.eqns[j].invars[0], a) for a in reduced_axes(self.g.eqns[j])) - {None}
            for j in reds
        }
        if len(sets) <= 1:
            return True
        return math.prod(max(ax.extents_all(c)) for c in frozenset().union(*sets)) <= STREAM_ELEMS

    def _output_classes(self, region: Region, ax: Axes) -> set[Node]:
        cs: set[Node] = set()
        for d in region.dots:
            cs |= ax.footprint(self.g.eqns[d].outvars[0])
        return cs

    def _free_classes(self, region: Region, ax: Axes, side: int) -> set[Node]:
        """Classes of the free dims of the region's dots' lhs (side 0: the matmul's M) or rhs (side 1: N)."""
        out: set[Node] = set()
        for d in region.dots:
            e = self.g.eqns[d]
            contracting, batch = (dims[side] for dims in e.params["dimension_numbers"])
            operand = e.invars[side]
            for k in range(len(operand.aval.shape)):
                if k not in contracting and k not in batch:
                    c = ax.cls(operand, k)
                    if c is not None:
                        out.add(c)
        return out

    def _m_classes(self, region: Region, ax: Axes) -> set[Node]:
        return self._free_classes(region, ax, 0)

    def _reduces_m(self, region: Region, ax: Axes, e: Any) -> bool:
        """A reduction of a matmul's epilogue along its rows (M: a column sum or max, `sum(y, axis=0)`): M is
        then walked as a sequential grid axis with the reductions kept in VMEM, like a long N."""
        if (
            region.kind != "matmul"
            or not region.dots
            or e.primitive.name not in ("reduce_sum", "reduce_max", "reduce_min")
        ):
            return False
        red = {ax.cls(e.invars[0], d) for d in reduced_axes(e)} - {None}
        m_classes = self._m_classes(region, ax)
        return bool(m_classes) and red == m_classes

    def _rows_used_once(self, region: Region, ax: Axes) -> bool:
        """Is every value of the region that spans M used once, inside the chain that ends in the M reduction?
        A norm over M (batch norm: `y - mean(y, axis=0)`) also needs y after its statistics: reducing in the
        epilogue would then split the norm into three kernels that read y twice, where one row-wise kernel
        over whole columns reads it once."""
        m_classes = self._m_classes(region, ax)
        if math.prod(max(ax.extents_all(c)) for c in m_classes) > COLUMN_WHOLE_ELEMS:
            return True  # columns too long to hold whole: the epilogue accumulates, whatever reads y later
        for j in region.eqns():
            for v in self.g.eqns[j].outvars:
                if ax.footprint(v) & m_classes and (
                    len(self.g.consumers.get(v, [])) != 1 or v in self.g.out_set
                ):
                    return False
        return True

    def _n_classes(self, region: Region, ax: Axes) -> set[Node]:
        return self._free_classes(region, ax, 1)

    # --- building -------------------------------------------------------------------------------------
    def run(self) -> None:
        """Give every owned equation a region: the families of `families.FAMILIES`, asked in order."""
        g = self.g
        for i in range(len(g.eqns)):
            if self.status[i] != "owned" or i in self.owner:
                continue
            if not any(f.matcher(self, i) for f in families_starting(g.kind[i])):
                raise AssertionError(f"no kernel family takes a `{g.eqns[i].primitive.name}` equation")
        self._layout_only_regions_to_glue()
        self._float_sinks()
        self._unpulled_layout_to_glue()
        self._widening_casts_to_readers()
        if self.opt.epilogue_reductions:
            absorb_pools(self)  # a pool after a conv: the conv kernel writes the pooled block

    def _widening_casts_to_readers(self) -> None:
        """A widening cast (bf16 -> f32) of a kernel's value that only other kernels read is computed by
        its readers: the kernel writes the narrow value, and each reader casts its block in VMEM. Kept in
        the producer, the cast is one more output twice as wide as the value (a bf16 conv's output and its
        f32 copy for the norm statistics: the conv wrote both and the norm kernel read both). The readers
        pull the cast (computed in their kernel, like a float they recompute); the producer writes the
        narrow value instead, if it did not already, and keeps the cast only for its own use (a sum of
        the f32 values in its epilogue)."""
        g = self.g
        for rid, r in list(self.regions.items()):
            for i in list(r.owned):
                e = g.eqns[i]
                if e.primitive.name != "convert_element_type" or len(r.owned) < 2:
                    continue
                src, out = e.invars[0], e.outvars[0]
                if is_literal(src) or not _widening_float(src, out) or out in g.out_set:
                    continue
                readers = g.consumers.get(out, [])
                if any(c not in self.owner or self.status[c] == "glue" for c in readers):
                    continue
                homes = {self.owner[c] for c in readers} - {rid}
                if not homes:
                    continue
                trial: dict[int, Axes] = {}
                for h in homes:
                    ax = self.regions[h].axes.copy()
                    try:
                        ax.add(e)
                    except Conflict:
                        break
                    trial[h] = ax
                if len(trial) != len(homes):
                    continue
                if all(self.owner[c] != rid for c in readers):  # nothing in the producer reads it
                    r.owned.remove(i)
                    del self.owner[i]
                for h, ax in trial.items():
                    self.regions[h].axes = ax
                    self.regions[h].pulled.add(i)

    def _layout_only_regions_to_glue(self) -> None:
        """A map region that owns nothing but layout ops (a transpose of a result its producer's kernel
        could not take, such as the stacked outputs of a scan) would be a kernel that copies the array
        through VMEM unchanged: one more read and write of it in HBM, on top of the transposes its wrapper
        does outside anyway (a [32, 2, 80, 64, 128] f32 scan output: 0.8 ms on v5e per the block model).
        Such ops run as glue instead, where XLA does the one layout change."""
        g = self.g
        for rid, r in list(self.regions.items()):
            if r.kind != "map" or r.dots or r.has_reduction or r.pulled or r.stream:
                continue
            if not all(g.kind[i] == "absorbed" and self.status[i] == "owned" for i in r.owned):
                continue
            for i in r.owned:
                self.status[i] = "glue"
                del self.owner[i]
            del self.regions[rid]

    def _unpulled_layout_to_glue(self) -> None:
        """A region may read a float value it does not compute: the conv kernel takes its input as an array,
        not the NCHW->NHWC transpose of one. When that value is layout of inputs alone (transposes,
        reshapes, broadcasts), XLA writes it once outside kernels; a value that computes is written once by a
        map kernel of its own."""
        g = self.g
        pulled = set().union(*(o.pulled for o in self.regions.values()))
        for r in list(self.regions.values()):
            for v in self.region_inputs(r):
                p = g.producer.get(v)
                if p is None or self.status[p] != "float" or p in self.owner:
                    continue
                chain = self.float_closure(v)
                if self._layout_only(chain) and not any(q in self.owner for q in chain):
                    for q in chain:
                        self.status[q] = "glue"
                        if q in pulled:  # another kernel recomputes it from its source
                            self.dual.add(q)
                elif not self._own_float(self.new_region("map"), p):
                    # it computes (a masked activation several matmuls read): a map kernel writes it once
                    raise AssertionError("a float equation failed to start its own region")

    def homes(self, e: Any) -> list[Region]:
        out: list[Region] = []
        for v in e.invars:
            if is_literal(v):
                continue
            p = self.g.producer.get(v)
            if p is not None and p in self.owner:
                r = self.regions[self.owner[p]]
                if r not in out:
                    out.append(r)
        return out

    def join(self, homes: list[Region], i: int) -> bool:
        if len(homes) >= 2 and self.opt.multi_dot:
            merged = self._try_merge(homes, i)
            if merged:
                return True
        for r in sorted(homes, key=lambda r: -r.id):
            if self.try_add(r, i):
                return True
        return False

    def join_sibling(self, i: int) -> bool:
        """A reduction of values computed outside any kernel (an input, its casts, a mask built from
        another input) joins the newest map region that already reads the largest input it needs: two
        reductions of one array (the log-sum-exp and the label's logit of a cross-entropy) then read it
        once, in one kernel. The region's template decides, as for any equation (same reduced axes when
        streamed, no cycle through other kernels)."""
        g = self.g
        if g.kind[i] != "reduce":
            return False
        sources: dict[Any, None] = {}  # ordered: `max` below breaks ties by program order, not by hash
        for v in g.eqns[i].invars:
            for p in [*self.float_closure(v), None]:
                ins = [v] if p is None else g.eqns[p].invars
                for w in ins:
                    if is_literal(w):
                        continue
                    q = g.producer.get(w)
                    if q is None or (self.status[q] == "glue" and q not in self.dual):
                        sources[w] = None
        # a kernel that already computes the operand for its own use (a one-hot mask a matmul's epilogue
        # weights its logits with) reduces it there, in the same pass
        operand = g.producer.get(g.eqns[i].invars[0])
        for r in sorted(self.regions.values(), key=lambda r: -r.id):
            if operand is not None and operand in r.pulled and self.try_add(r, i):
                return True
        if not sources:
            return False
        biggest = max(sources, key=_elems)
        for r in sorted(self.regions.values(), key=lambda r: -r.id):
            if r.kind == "map" and biggest in self.region_inputs(r) and self.try_add(r, i):
                return True
        return False

    def _try_merge(self, homes: list[Region], i: int) -> bool:
        """Two matmul regions combined elementwise (gate * up): one kernel, one accumulator per dot."""
        if len(homes) != 2 or not all(r.kind == "matmul" and not r.has_reduction for r in homes):
            return False
        a, b = homes
        ks = set()
        for r in homes:
            for d in r.dots:
                e = self.g.eqns[d]
                (lc, _), _ = e.params["dimension_numbers"]
                k = 1
                for ax_ in lc:
                    k *= int(e.invars[0].aval.shape[ax_])
                ks.add(k)
        if len(ks) != 1:
            return False
        ext_a = self._external_inputs(a, a.eqns())
        ext_b = self._external_inputs(b, b.eqns())
        if any(self._depends_on(v, b, set()) for v in ext_a) or any(
            self._depends_on(v, a, set()) for v in ext_b
        ):
            return False
        combined = Region(id=a.id, kind="matmul", axes=a.axes.copy())
        combined.owned = [*a.owned, *b.owned]
        combined.pulled = a.pulled | b.pulled
        combined.dots = [*a.dots, *b.dots]
        try:
            for j in b.eqns():
                combined.axes.add(self.g.eqns[j])
        except Conflict:
            return False
        prepared = self.prepare(combined, i)
        if prepared is None:
            return False
        ax, pulls = prepared
        outs = [ax.footprint(self.g.eqns[d].outvars[0]) for d in combined.dots]
        if any(o != outs[0] for o in outs):
            return False
        del self.regions[b.id]
        self.regions[a.id] = combined
        for j in combined.owned:
            self.owner[j] = a.id
        self.commit(combined, i, ax, pulls)
        return True

    def start(self, i: int, kind: str) -> Region:
        r = self.new_region(kind)
        e = self.g.eqns[i]
        if kind == "matmul":
            r.dots.append(i)
            # pull only absorbed floats (casts, transposes, broadcasts) into the operands' loads
            pulls: list[int] = []
            for v in e.invars:
                chain = self.float_closure(v)
                if chain and all(
                    self.g.kind[p] == "absorbed" and self.g.eqns[p].primitive.name != "iota" for p in chain
                ):
                    pulls.extend(chain)
            for j in sorted(set(pulls)):
                r.axes.add(self.g.eqns[j])
            r.pulled.update(pulls)
            r.axes.add(e)
            r.owned.append(i)
            self.owner[i] = r.id
            return r
        if not self.try_add(r, i):
            # its floats clash with it: compute them in a map kernel of their own, then take it alone
            for v in e.invars:
                if is_literal(v):
                    continue
                p = self.g.producer.get(v)
                if p is not None and self.status[p] == "float" and p not in self.owner:
                    fr = self.new_region("map")
                    if not self._own_float(fr, p):
                        raise AssertionError("a float equation failed to start its own region")
            r.axes = Axes(self.g)
            r.pulled = set()
            r.axes.add(e)
            r.owned.append(i)
            self.owner[i] = r.id
            r.has_reduction = self.g.kind[i] == "reduce"
            if r.has_reduction and self.reduced_extent(r.axes, e) > STREAM_ELEMS:
                r.stream = True
        return r

    def _float_sinks(self) -> None:
        """Float values the program returns or a glue op needs are computed by a map kernel of their own."""
        g = self.g
        needed: list[Any] = []
        for v in g.outvars:
            if not is_literal(v) and v in g.producer and self.status[g.producer[v]] == "float":
                needed.append(v)
        for i, e in enumerate(g.eqns):
            if self.status[i] != "glue":
                continue
            for v in e.invars:
                if is_literal(v):
                    continue
                p = g.producer.get(v)
                if p is not None and self.status[p] == "float" and g.kind[p] != "absorbed":
                    needed.append(v)
                elif (
                    p is not None
                    and self.status[p] == "float"
                    and self.float_closure(v)
                    and any(g.kind[q] == "elementwise" for q in self.float_closure(v))
                ):
                    needed.append(v)
        done: dict[Any, Region] = {}
        current: Region | None = None
        biggest = max((_elems(v) for v in g.invars), default=1)
        for v in dict.fromkeys(needed):
            p = g.producer[v]
            if p in self.owner:
                continue
            chain = [q for q in self.float_closure(v) if self.status[q] == "float"]
            work = sum(_elems(w) for q in chain if g.kind[q] == "elementwise" for w in g.eqns[q].outvars)
            if v not in g.out_set and work <= min(TINY_GLUE_ELEMS, biggest // 100):
                for q in chain:  # index arithmetic on a few values: plain XLA next to the gather
                    self.status[q] = "glue"
                continue
            placed = False
            # one map kernel writes several such values only when they share its iteration space: values of
            # unrelated shapes (a mask per sequence of a ragged batch) joined into one would make its grid
            # the product of all their axes
            if current is not None and self._float_fits(current, p) and self._acyclic_with(current, p):
                placed = self._own_float(current, p)
            if not placed:
                current = self.new_region("map")
                if not self._own_float(current, p):
                    raise AssertionError("a float equation failed to start its own region")
            done[v] = current

    def _computations(self, region: Region, ax: Axes, *new: int) -> int:
        """How many independent computations the map kernel `region` (with equations `new`) holds: groups of
        its values joined by sharing an axis. The map builder lines up the axes of two of one shape
        (`MapBuilder._independent_pair`: the rope of the queries and of a shared key); with a third every
        match is ambiguous and the grid is the product of their axes (the masked outputs of a ragged
        batch's sequences: 2^31 steps)."""
        eqns = [*region.owned, *region.pulled, *new]
        fps = [
            fp
            for j in eqns
            for v in [*self.g.eqns[j].invars, *self.g.eqns[j].outvars]
            if not is_literal(v) and (fp := ax.footprint(v))
        ]
        groups: list[set[Node]] = []
        for fp in fps:
            joined = [g for g in groups if g & fp]
            merged = set(fp).union(*joined)
            groups = [g for g in groups if not g & fp] + [merged]
        return len(groups)

    def _float_axes(self, region: Region, p: int) -> tuple[list[int], Axes] | None:
        """Float equation `p`'s float inputs and `region`'s axes with them and `p` added (None: they conflict)."""
        chain = [q for q in self.float_closure(self.g.eqns[p].outvars[0]) if q != p]
        ax = region.axes.copy()
        try:
            for q in [*chain, p]:
                if q not in region.pulled and q not in region.owned:
                    ax.add(self.g.eqns[q])
        except Conflict:
            return None
        return chain, ax

    def _float_fits(self, region: Region, p: int) -> bool:
        """Float equation `p` (with its float inputs) may join `region`: it stays one computation, or becomes
        the second of two of the same shape (`_computations`)."""
        got = self._float_axes(region, p)
        if got is None:
            return False
        n = self._computations(region, got[1], *got[0], p)
        if n <= 1:
            return True
        # a second computation lines up with the first only at the same shape (every traced configuration)
        shapes = self.g.traces.shapes(self.g.eqns[p].outvars[0])
        return n == 2 and any(
            self.g.traces.shapes(w) == shapes for q in region.owned for w in self.g.eqns[q].outvars
        )

    def _acyclic_with(self, region: Region, p: int) -> bool:
        """Can float equation `p` (with its float inputs) join `region` without the region needing, through
        glue or other kernels, a value it computes itself (a returned value computed from a kernel's
        output next to a value that kernel's input glue needs)?"""
        chain = [q for q in self.float_closure(self.g.eqns[p].outvars[0]) if q != p]
        trial = Region(id=-1, kind=region.kind, axes=region.axes)
        trial.owned = [*region.owned, p]
        trial.pulled = region.pulled | set(chain)
        return not any(self._depends_on(v, trial, set()) for v in self.region_inputs(trial))

    def _own_float(self, region: Region, p: int) -> bool:
        """Make float equation `p` (and its float inputs) owned by a map region, so its result is stored."""
        got = self._float_axes(region, p)
        if got is None:
            return False
        chain, region.axes = got
        region.pulled.update(q for q in chain if q not in region.owned)
        region.owned.append(p)
        self.owner[p] = region.id
        return True

    # --- results --------------------------------------------------------------------------------------
    def region_outputs(self, region: Region) -> list[Any]:
        """Values a region must write: used by glue, another region, or returned."""
        g = self.g
        owned = set(region.owned)
        outs: list[Any] = []
        for i in sorted(owned):
            for v in g.eqns[i].outvars:
                used_outside = v in g.out_set
                for c in g.consumers.get(v, []):
                    if c in owned:
                        continue
                    if self.status[c] == "glue":
                        used_outside = True
                    elif c in self.owner and self.owner[c] != region.id:
                        # unless that kernel computes the value itself (`_widening_casts_to_readers`)
                        used_outside = used_outside or i not in self.regions[self.owner[c]].pulled
                    elif c not in self.owner and any(
                        c in o.pulled for o in self.regions.values() if o.id != region.id
                    ):
                        used_outside = True  # read by a cast another kernel computes
                if used_outside:
                    outs.append(v)
        return outs

    def region_inputs(self, region: Region) -> list[Any]:
        produced = self.produced_in(region)
        ins: list[Any] = []
        for i in region.eqns():
            for v in self.g.eqns[i].invars:
                if not is_literal(v) and v not in produced and v not in ins:
                    ins.append(v)
        return ins
