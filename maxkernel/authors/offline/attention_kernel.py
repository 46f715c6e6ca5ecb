"""Flash attention (online softmax over key blocks) and its no-softmax variant (chained matmuls).

Transforms applied here, each because it removes work a TPU would otherwise do:

* static masks (causal, sliding window, `tril` of a constant, anything built from positions and static
  scalars) become a *schedule*: the wrapper evaluates the kernel's own mask code per (q block, key block)
  while tracing and the grid walks only the live pairs, read from scalar-prefetched tables, so a masked key
  block is neither fetched nor computed nor stepped over (`plan_schedule`); a mask read from an operand
  keeps the per-block `pl.when` skip (compute only);
* an f32 HIGHEST probs @ v whose v is a widened bf16 runs as three exact bf16 MXU passes (`pv_product`),
  and a HIGHEST score dot of two widened bf16 operands as one, so the kernel pays for the precision the
  reference has and no more.
"""

from __future__ import annotations

import math
import re
from typing import Any

from maxkernel.authors.offline.dataflow import is_literal
from maxkernel.authors.offline.emit import EmitError, dtype_code, dtype_name, is_float
from maxkernel.authors.offline.kernels import (
    Builder,
    LowerError,
    Scope,
    Space,
    SpaceDim,
    StepSchedule,
    _constant_value,
    nelems,
    op_summary,
    precision_arg,
)
from maxkernel.authors.offline.paged import PagedAttention
from maxkernel.authors.offline.spec import BufferSpec

LAYOUT_PRIMS = (
    "convert_element_type",
    "broadcast_in_dim",
    "reshape",
    "squeeze",
    "expand_dims",
    "copy",
    "copy_p",
)
"""Primitives that move or widen a value without changing which rows/keys it describes."""

MAX_GROUP_FOLD = 16
"""Most query heads folded into one block per K/V head: the score tile is group x bq x bkv f32 (x3 live)."""

MASK_FILL_AS_NEG_INF = -1e4
"""A mask fill at or below this (-1e9, `finfo.min`) acts as -inf for block skipping: exp(fill - m) is exactly 0
in float32 beside any live score above fill + 104."""


_ZERO_PRESERVING = ("abs", "neg", "convert_element_type", "copy", "copy_p", "integer_pow", "square", "mul")


def _zero_preserving(g: Any, var: Any, source: Any, own: set[int]) -> bool:
    """Is `var` zero wherever `source` is: computed from it by a chain of ops that map 0 to 0 (a product
    needs one factor on the chain)?"""
    while var is not source:
        p = g.producer.get(var)
        if p is None or p not in own or g.eqns[p].primitive.name not in _ZERO_PRESERVING:
            return False
        e = g.eqns[p]
        if e.primitive.name == "integer_pow" and int(e.params["y"]) <= 0:
            return False
        ins = [w for w in e.invars if not is_literal(w)]
        on = [w for w in ins if w is source or g.producer.get(w) in own]
        if e.primitive.name == "mul":
            nxt = [w for w in on if w is source or _zero_preserving(g, w, source, own)]
            return bool(nxt)
        if len(ins) != 1:
            return False
        var = ins[0]
    return True


class AttentionBuilder(PagedAttention, Builder):
    """Flash attention: online softmax over key blocks, scores never leave VMEM."""

    merge_head_lanes = True  # [B, S, H, D] operands read in place: the head is a lane block

    family = "attention"

    def make_space(self) -> None:
        g, ax = self.g, self.ax
        info = self.region.attention
        assert info is not None
        e1 = g.eqns[info.score_dots[0]]
        s = e1.outvars[0]
        kv = ax.find(info.kv_class)  # type: ignore[arg-type]
        self.kv_class = kv
        s_classes = [c for c in ax.classes(s) if c is not None]
        rows = [c for c in s_classes if c != kv]
        qside = self.q_side(e1)
        (lcr, (lbl, lbr)) = e1.params["dimension_numbers"]
        contract, batch = (lcr[qside], (lbl, lbr)[qside])
        lhs = e1.invars[qside]
        lfree = [ax.cls(lhs, d) for d in range(len(lhs.aval.shape)) if d not in contract and d not in batch]
        lfree = [c for c in lfree if c is not None]
        # the query rows: the longest free axis of the query side (the last among equals); a grouped-query
        # reference's head group is a short free axis too, in front of the rows or behind them
        q_cls = [max(reversed(lfree), key=lambda c: max(ax.extents_all(c)))] if lfree else []
        uses_positions = any(g.eqns[i].primitive.name == "iota" for i in self.region.eqns())
        if not info.softmax and not uses_positions:
            q_cls = self.mlp_rows(lfree) or q_cls
        grid = [c for c in rows if c not in q_cls]
        shared = self.shared_kv_rows(grid, lfree) if q_cls else []
        grid = [c for c in grid if c not in shared]
        dims: list[SpaceDim] = []
        for k, c in enumerate(grid):
            dims.append(SpaceDim(key=f"h{k}" if len(grid) > 1 else "h", classes=[c], role="grid"))
        # query heads that share one K/V head (grouped-query attention) ride in one block: [group, bq, d]
        self.grp: SpaceDim | None = SpaceDim(key="g", classes=shared, role="full") if shared else None
        self.q = SpaceDim(key="q", classes=q_cls, role="tiled", param=f"{self.cprefix}BLOCK_Q")
        self.kv = SpaceDim(key="kv", classes=[kv], role="seq", param=f"{self.cprefix}BLOCK_KV")
        self.kv.lane_use = True
        dims += [*self.rows_lead(), self.q, self.kv]
        self.dq: list[SpaceDim] = []
        for i, d in enumerate(info.score_dots):
            e = g.eqns[d]
            qs = self.q_side(e)
            cdims = e.params["dimension_numbers"][0][qs]
            cs = [ax.cls(e.invars[qs], a) for a in cdims]
            self.dq.append(
                SpaceDim(
                    key="d" if i == 0 else f"d{i}", classes=[c for c in cs if c is not None], role="full"
                )
            )
        dims += self.dq
        pv = g.eqns[info.pv_dot]
        dv = [c for c in ax.classes(pv.outvars[0]) if c is not None and c not in rows]
        self.dv = SpaceDim(key="dv", classes=dv, role="full")
        dims.append(self.dv)
        axis = 0
        for d in dims:
            if d.role in ("grid", "tiled"):
                d.axis = axis
                axis += 1
        self.kv.axis = axis
        self.dims = dims
        self.score = Space("score", [*self.rows_lead(), self.q, self.kv])
        self.epi = Space("epi", [*self.rows_lead(), self.q, self.dv])
        if self.grp is not None:
            self.notes.append(
                "the query heads of one K/V group share a block ([group, bq, d] against one [bkv, d] K/V "
                "block): each K/V block is fetched once per group, not once per query head, and the MXU sees "
                "group x bq rows per key block"
            )
        if not info.softmax:
            self.family = "linear_attention" if uses_positions else "fused_mlp"
            self.stem = self.stem.replace("_attention", f"_{self.family}")
        self.plan_paged()

    def shared_kv_rows(self, grid: list[Any], lfree: list[Any]) -> list[Any]:
        """Query-only row axes (the heads of a K/V group): free on the query side, absent from every K and V
        operand. Keeping them whole in the query block lets one fetched K/V block serve the whole group,
        instead of the grid refetching it once per query head. Only small groups: the score tile grows by
        the group size."""
        ax = self.ax
        kv_fp = self.kv_footprint()
        free = {ax.find(c) for c in lfree}
        shared = [c for c in grid if ax.find(c) in free and ax.find(c) not in kv_fp]
        size = math.prod(max(ax.extents_all(c)) for c in shared) if shared else 1
        if size <= 1 or size > MAX_GROUP_FOLD:
            return []
        return shared

    def kv_footprint(self) -> set[Any]:
        """The axes any K/V operand (the key side of a score dot, the value side of probs @ v) varies along."""
        g, ax = self.g, self.ax
        info = self.region.attention
        assert info is not None
        kv_fp: set[Any] = set()
        for d in info.score_dots:
            e = g.eqns[d]
            kv_fp |= {ax.find(c) for c in ax.footprint(e.invars[1 - self.q_side(e)])}
        pv = g.eqns[info.pv_dot]
        kv_fp |= {ax.find(c) for c in ax.footprint(pv.invars[1 - info.probs_side])}
        return kv_fp

    def mlp_rows(self, lfree: list[Any]) -> list[Any]:
        """The query-side row axes a chained-matmul (MLP) kernel tiles as one merged row dim: the longest
        trailing run of the first dot's free axes that no K/V operand (the weights) varies along and that
        every operand and result of the region spans all or none of. A ConvNeXt MLP over (N, H, W, C)
        otherwise walks N x H grid steps of W rows each (7168 steps of 56 rows at 128 x 56 x 56, the step
        overhead dominating); merged, its blocks are bq rows of N * H * W, and the view is a reshape of
        contiguous leading dims (no copy where the row tile divides them)."""
        ax = self.ax
        kv_fp = self.kv_footprint()
        best: list[Any] = []
        for k in range(len(lfree) - 1, -1, -1):
            run = lfree[k:]
            found = {ax.find(c) for c in run}
            if found & kv_fp or len(found) != len(run):
                break
            spans = ({ax.find(c) for c in ax.footprint(v)} & found for v in [*self.inputs, *self.outputs])
            if all(not s or s == found for s in spans):
                best = run
        return best if len(best) > 1 else []

    def row_group(self) -> int:
        return self.group_extent(self.grp) if self.grp is not None else 1

    def rows_lead(self) -> list[SpaceDim]:
        """The row dims before the query rows in every tile (the K/V group), empty without one."""
        return [self.grp] if self.grp is not None else []

    def row_dot(self, lhs: str, rhs: str, dims: str, tail: str) -> str:
        """An MXU product whose lhs may carry the K/V group as a leading dim: [group, bq, x] is merged to
        [group * bq, x] so the group's rows share one pass over the rhs (Mosaic compiles the merge for
        aligned and unaligned bq alike), and the result is split back."""
        if self.grp is None:
            return f"lax.dot_general({lhs}, {rhs}, {dims}{tail})"
        return (
            f"lax.dot_general({lhs}.reshape(-1, {lhs}.shape[-1]), {rhs}, {dims}{tail})"
            f".reshape({lhs}.shape[:-1] + (-1,))"
        )

    def q_side(self, e: Any) -> int:
        """Which operand of a score dot holds the queries (the other's free dim is the key axis)."""
        kv = self.ax.find(self.region.attention.kv_class)  # type: ignore[union-attr,arg-type]
        (lc, rc), (lb, rb) = e.params["dimension_numbers"]
        rhs = e.invars[1]
        rfree = {self.ax.cls(rhs, d) for d in range(len(rhs.aval.shape)) if d not in rc and d not in rb}
        return 0 if kv in rfree else 1

    def out_space(self) -> Space:
        return self.epi

    def scratch(self) -> list[tuple[str, str, list[SpaceDim | str]]]:
        info = self.region.attention
        lead: list[SpaceDim | str] = [*self.rows_lead()]
        if self.page_heads is not None:  # one online-softmax state per head of a page (walked in the kernel)
            lead.insert(0, self.page_heads)
        acc = [("acc_ref", "jnp.float32", [*lead, self.q, self.dv])]
        if info is not None and info.softmax:
            return [
                ("m_ref", "jnp.float32", [*lead, self.q, "1"]),
                ("l_ref", "jnp.float32", [*lead, self.q, "1"]),
                *acc,
            ]
        if info is not None and info.row_norm:
            return [("l_ref", "jnp.float32", [*lead, self.q, "1"]), *acc]
        return acc

    def make_body(self) -> list[str]:
        g = self.g
        info = self.region.attention
        assert info is not None
        main = Scope(lines=[], indent="    ")
        kv_index = self.program_id(self.kv.axis)  # type: ignore[arg-type]
        self.mask_select: tuple[Any, Any] | None = None  # (masked value, its unmasked input), see block_mask
        self.finite_fill = False  # set by block_mask
        pred = self.block_mask(info.logits if info.softmax else info.probs, "-inf" if info.softmax else "0")
        scheduled = pred is not None and self.plan_schedule(pred)
        if pred is not None and not scheduled and self.finite_fill:
            pred = (
                None  # only the static schedule can see rows with no live key; a data-dependent skip cannot
            )
        # a mask that reads an operand but is ANDed with a static one (ragged: same segment & causal): the grid
        # walks the static part's live pairs and the whole mask, applied on every step, does the rest
        partial = pred is not None and not scheduled and self.plan_static_conjunct(pred)
        scheduled = scheduled or partial
        if pred is not None and not scheduled:
            self.plan_length_clamp(pred)
        step = f"pl.program_id({getattr(self, 'step_axis', 0)})"
        first = f"(step_flags_ref[{step}] & 1) != 0" if scheduled else f"{kv_index} == 0"
        last = (
            f"(step_flags_ref[{step}] & 2) != 0"
            if scheduled
            else f"{kv_index} == pl.num_programs({self.kv.axis}) - 1"
        )
        main.add(f"@pl.when({first})")
        main.add("def _init():")
        if info.softmax:
            main.add("    m_ref[...] = jnp.full_like(m_ref, -jnp.inf)")
        if info.softmax or info.row_norm:
            main.add("    l_ref[...] = jnp.zeros_like(l_ref)")
        main.add("    acc_ref[...] = jnp.zeros_like(acc_ref)")
        main.add("")
        for i, d in enumerate(info.score_dots):
            e = g.eqns[d]

            def score_dot(scope: Scope, space: Space, e: Any = e, i: int = i) -> tuple[str, frozenset[str]]:
                qs = Space(f"q{i}", [*self.rows_lead(), self.q, self.dq[i]])
                ks = Space(f"k{i}", [self.kv, self.dq[i]])
                side = self.q_side(e)
                qv, kvv = e.invars[side], e.invars[1 - side]
                prec = precision_arg(e)
                narrow_q, narrow_k = self.widened_bf16(qv), self.widened_bf16(kvv)
                if narrow_q is not None and narrow_k is not None:
                    # f32 widenings of bf16 on both sides: one bf16 MXU pass with f32 accumulation is exact (the
                    # products of bf16 values are exact in f32), so an f32 dot at any precision adds nothing
                    qv, kvv, prec = narrow_q, narrow_k, ""
                a, am = self.value(qv, qs, scope)
                b, bm = self.value(kvv, ks, scope)
                a, am = self.materialise(
                    a,
                    am,
                    {self.q.key, self.dq[i].key} if self.q.classes else {self.dq[i].key},
                    qs,
                    scope,
                    dtype_name(qv.aval),
                )
                b, _ = self.materialise(b, bm, {self.kv.key, self.dq[i].key}, ks, scope, dtype_name(kvv.aval))
                dt = dtype_name(e.outvars[0].aval)
                pref = "jnp.float32" if is_float(dt) else dtype_code(dt)
                nm = self.fresh("scores")
                mat = frozenset({self.q.key, self.kv.key}) if self.q.classes else frozenset({self.kv.key})
                if self.grp is not None and self.grp.key in am:
                    mat |= {self.grp.key}
                cast = "" if dt == "float32" else f".astype({dtype_code(dt)})"
                dot = self.row_dot(a, b, "(((1,), (1,)), ((), ()))", f", preferred_element_type={pref}{prec}")
                scope.add(f"{nm} = {dot}{cast}" + self.comment(dt, space, mat))
                return nm, mat

            main.special[e.outvars[0]] = score_dot
        need = {self.q.key, self.kv.key} if self.q.classes else {self.kv.key}
        self.kw("n_kv", "n_kv")
        self.kw(self.kv.blk, self.kv.blk)
        pv = g.eqns[info.pv_dot]
        vspace = Space("v", [self.kv, self.dv])
        pdt = dtype_name(pv.invars[info.probs_side].aval)
        v_var = pv.invars[1 - info.probs_side]
        outer = main
        if pred is not None and (not scheduled or partial):
            pcode, _ = self.value(pred, self.score, main)
            main.add(f"live = jnp.any({pcode})  # key blocks the mask removes entirely are skipped")
            main.add("")
            main.add("@pl.when(live)")
            main.add("def _update():")
            main = Scope(lines=main.lines, indent="        ", cache=dict(main.cache), special=main.special)
            self.notes.append(
                "key blocks whose mask is all false are skipped (pl.when), e.g. above a causal diagonal"
            )

        def emit_update(main: Scope) -> None:
            if info.softmax:
                logits = info.logits
                gcode, gm = self.value(logits, self.score, main)
                gcode, gm = self.materialise(gcode, gm, need, self.score, main, dtype_name(logits.aval))
                main.add(f"if n_kv % {self.kv.blk}:  # padded keys exist: keep them out of the softmax")
                main.add(
                    f"    kv_pos = {kv_index} * {self.kv.blk} + lax.broadcasted_iota(jnp.int32, (1, {self.kv.blk}), 1)"
                )
                main.add(f"    {gcode} = jnp.where(kv_pos < n_kv, {gcode}, -jnp.inf)")
                main.add("m_prev = m_ref[...]  # f32[bq, 1]: row max over the key blocks seen so far")
                main.add(f"m_next = jnp.maximum(m_prev, jnp.max({gcode}, axis=-1, keepdims=True))")
                main.add(
                    "m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows whose keys are all masked so far"
                )
                main.add(f"probs = jnp.exp({gcode} - m_safe)  # f32[bq, bkv], unnormalised")
                main.add(
                    "rescale = jnp.exp(m_prev - m_safe)  # corrects what was accumulated under the old max"
                )
                main.add("l_ref[...] = rescale * l_ref[...] + jnp.sum(probs, axis=-1, keepdims=True)")
                main.add("m_ref[...] = m_next")
                pcast = "probs" if pdt == "float32" else f"probs.astype({dtype_code(pdt)})"
                pv_expr = self.pv_product(pcast, pdt, v_var, vspace, main)
                main.add(f"acc_ref[...] = rescale * acc_ref[...] + {pv_expr}")
                self.transcendentals = 2  # exp of the scores and of the rescale, once per update
            else:
                if info.row_norm:
                    # the quotient num / den(l) is num here; the kernel divides by den(l) once, at the end
                    main.special[info.norm_div] = lambda scope, space: self.value(info.norm_num, space, scope)
                    scode, sm = self.value(info.sum_operand, self.score, main)
                    scode, sm = self.materialise(
                        scode, sm, need, self.score, main, dtype_name(info.sum_operand.aval)
                    )
                pcode, pm = self.value(info.probs, self.score, main)
                pcode, pm = self.materialise(pcode, pm, need, self.score, main, pdt)
                main.add(f"if n_kv % {self.kv.blk}:  # padded keys exist: they must add nothing")
                main.add(
                    f"    kv_pos = {kv_index} * {self.kv.blk} + lax.broadcasted_iota(jnp.int32, (1, {self.kv.blk}), 1)"
                )
                main.add(f"    {pcode} = jnp.where(kv_pos < n_kv, {pcode}, 0)")
                if info.row_norm:
                    main.add(f"    {scode} = jnp.where(kv_pos < n_kv, {scode}, 0)")
                    main.add(
                        f"l_ref[...] += jnp.sum({scode}.astype(jnp.float32), axis=-1, keepdims=True)"
                        "  # the row sum the divisor is made of"
                    )
                main.add(f"acc_ref[...] += {self.pv_product(pcode, pdt, v_var, vspace, main)}")

        if scheduled and not partial and self.mask_select is not None:
            # blocks wholly inside the mask skip its VPU work (iotas, compares, select): most live blocks of a
            # causal or banded mask; only blocks the mask cuts through run the masked version
            masked = f"(step_flags_ref[{step}] & 4) != 0"
            sel_out, sel_true = self.mask_select
            for name, skip in (("_masked", False), ("_unmasked", True)):
                main.add("")
                main.add(f"def {name}():")
                inner = Scope(
                    lines=main.lines, indent="        ", cache=dict(main.cache), special=dict(main.special)
                )
                if skip:
                    inner.special[sel_out] = lambda scope, space, v=sel_true: self.value(v, space, scope)
                emit_update(inner)
            main.add("")
            # one cond, not two exclusive pl.when: each step runs one body (and the block model, which charges
            # a cond's dearest branch, sees one)
            main.add(f"lax.cond({masked}, _masked, _unmasked)")
            self.notes.append(
                "key blocks wholly inside the mask skip the mask's VPU work (a second, mask-free body)"
            )
        else:
            emit_update(main)
        main = outer
        main.add("")
        main.add(f"@pl.when({last})")
        main.add("def _finalize():")
        fin = Scope(lines=[], indent="        ")
        out = pv.outvars[0]
        odt = dtype_name(out.aval)

        def load_out(scope: Scope, space: Space) -> tuple[str, frozenset[str]]:
            nm = self.fresh("attn")
            div = " / l_ref[...]" if info.softmax and info.normalised_before_pv else ""
            if info.row_norm:
                den, _ = self.value(info.norm_den, space, scope)
                div = f" / {den}"
            cast = "" if odt == "float32" else f".astype({dtype_code(odt)})"
            expr = f"(acc_ref[...]{div}){cast}" if cast and div else f"acc_ref[...]{div}{cast}"
            mat = frozenset(
                k for k, d in ((self.q.key, self.q), (self.dv.key, self.dv), *self.lead_pairs()) if d.classes
            )
            scope.add(f"{nm} = {expr}" + self.comment(odt, space, mat))
            return nm, mat

        fin.special[out] = load_out
        if info.softmax or info.row_norm:
            stats = (
                ((info.row_max, "m_ref"), (info.row_sum, "l_ref"))
                if info.softmax
                else ((info.row_sum, "l_ref"),)
            )
            for var, ref in stats:

                def load_stat(
                    scope: Scope, space: Space, ref: str = ref, var: Any = var
                ) -> tuple[str, frozenset[str]]:
                    nm = self.fresh(ref[0])
                    dt = dtype_name(var.aval)
                    cast = "" if dt == "float32" else f".astype({dtype_code(dt)})"
                    rows = frozenset({self.q.key, *(d.key for d in self.rows_lead())})
                    scope.add(f"{nm} = {ref}[...]{cast}" + self.comment(dt, space, rows))
                    return nm, rows

                fin.special[var] = load_stat
        names = ["out"] if len(self.outputs) == 1 else [f"out{i}" for i in range(len(self.outputs))]
        for v, nm in zip(self.outputs, names, strict=True):
            self.store(v, f"{nm}_ref", self.epi, fin)
        return main.lines + fin.lines

    def lead_pairs(self) -> list[tuple[str, SpaceDim]]:
        return [(d.key, d) for d in self.rows_lead()]

    def note(self, text: str) -> None:
        """Add a note once (the update body may be emitted twice: masked and mask-free blocks)."""
        if text not in self.notes:
            self.notes.append(text)

    def widened_bf16(self, var: Any) -> Any | None:
        """The bf16 value that `var` is an f32 widening of (cast inside the region), else None."""
        p = self.g.producer.get(var)
        if is_literal(var) or p is None or p not in set(self.region.eqns()):
            return None
        e = self.g.eqns[p]
        src = e.invars[0]
        if e.primitive.name != "convert_element_type" or is_literal(src):
            return None
        if dtype_name(src.aval) != "bfloat16" or dtype_name(var.aval) != "float32":
            return None
        return src

    def pv_product(self, pcode: str, pdt: str, v_var: Any, vspace: Space, scope: Scope) -> str:
        """probs @ v as an f32 expression, at the reference's precision and no more.

        A HIGHEST-precision f32 dot whose v is a widened bf16 needs no f32 x f32 MXU work: the f32
        probabilities split exactly into three bf16 terms (8 + 8 + 8 mantissa bits), and each term times
        the bf16 v is exact on the MXU with f32 accumulation. Three bf16 passes compute what HIGHEST's six
        compute here (the three that multiply v's low bits are zero), so the result keeps f32 accuracy.
        When every output is rounded to bf16/f16, the third term (bits 17-24) cannot change it: two.
        """
        pv = self.g.eqns[self.region.attention.pv_dot]  # type: ignore[union-attr]
        prec = precision_arg(pv)
        narrow = self.widened_bf16(v_var) if prec and pdt == "float32" else None
        src = narrow if narrow is not None else v_var
        v, vm = self.value(src, vspace, scope)
        v, _ = self.materialise(
            v,
            vm,
            {self.kv.key, self.dv.key} if self.dv.classes else {self.kv.key},
            vspace,
            scope,
            dtype_name(src.aval),
        )
        nt = "(((1,), (0,)), ((), ()))"
        if narrow is None:
            if self.grp is not None and not pcode.isidentifier():
                named = self.fresh("p")
                scope.add(f"{named} = {pcode}")
                pcode = named
            return self.row_dot(pcode, v, nt, f", preferred_element_type=jnp.float32{prec}")
        p = self.fresh("p")
        # Every output rounded to 16 bits: two terms (16 mantissa bits of the probabilities, error 2^-17)
        # are far below the output's own rounding (2^-9); an f32 output keeps all three.
        terms = (
            ("lo", "hi")
            if all(dtype_name(o.aval) in ("bfloat16", "float16") for o in self.outputs)
            else (
                "lo",
                "mid",
                "hi",
            )
        )
        scope.add(f"{p}_hi = {pcode}.astype(jnp.bfloat16)  # f32 probs = hi + lo (+ mid), each bf16")
        if len(terms) == 2:
            scope.add(f"{p}_lo = ({pcode} - {p}_hi.astype(jnp.float32)).astype(jnp.bfloat16)")
        else:
            scope.add(f"{p}_rest = {pcode} - {p}_hi.astype(jnp.float32)")
            scope.add(f"{p}_mid = {p}_rest.astype(jnp.bfloat16)")
            scope.add(f"{p}_lo = ({p}_rest - {p}_mid.astype(jnp.float32)).astype(jnp.bfloat16)")
        self.note(
            f"the f32 (HIGHEST) probs @ v runs as {len(terms)} bf16 MXU passes: v is a widened bf16 and the f32 "
            + (
                "probabilities split exactly into three bf16 terms"
                if len(terms) == 3
                else "probabilities split into two bf16 terms (16 bits, below the 16-bit output's rounding)"
            )
        )
        return " + ".join(
            self.row_dot(f"{p}_{t}", v, nt, ", preferred_element_type=jnp.float32") for t in terms
        )

    def plan_schedule(self, pred: Any) -> bool:
        """Walk only the (q block, key block) pairs the mask leaves alive, when the mask is static.

        A mask built from positions and static scalars (causal, sliding window, a block layout computed
        from iotas) is known at trace time, so the wrapper evaluates it once per block pair with the very
        code the kernel uses, and the grid walks a flat list of live pairs read from scalar-prefetched
        tables. Masked-out key blocks then cost no DMA, no compute and no grid step (a `pl.when` guard
        alone would still pay the copy and the step). A mask that reads an operand stays a per-block
        `pl.when` skip.
        """
        if not self.q.classes or self.q.axis is None or self.kv.axis is None:
            return False
        scope = Scope(lines=[], indent="    ")
        axes_before = set(self.axis_used)
        kw_before = dict(self.kernel_kw)
        try:
            code, _ = self.value(pred, self.score, scope)
        except (LowerError, EmitError):
            self.kernel_kw = kw_before
            self.axis_used = axes_before
            return False
        if any("_ref" in line for line in scope.lines) or not (self.axis_used - axes_before) <= {
            self.q.axis,
            self.kv.axis,
        }:
            self.kernel_kw = kw_before
            self.axis_used = axes_before | {self.q.axis, self.kv.axis}
            return False
        self.axis_used |= {self.q.axis, self.kv.axis}
        text = "\n".join(scope.lines)
        names = sorted(k for k in self.kernel_kw if re.search(rf"\b{re.escape(k)}\b", text))
        stem = self.stem
        sig = "q_index, kv_index" + (", *, " + ", ".join(names) if names else "")
        live_fn = (
            f"def {stem}_block_live({sig}):\n"
            '    """Whether any / every score of the (q block, key block) tile survives the mask: the kernel\'s own\n'
            '    mask code, evaluated at trace time to build the schedule."""\n'
            f"{text}\n"
            f"    return jnp.any({code}), jnp.all({code}), jnp.any(jnp.atleast_1d({code}), axis=-1)\n"
        )
        sched_fn = (
            f"def {stem}_schedule(n_q_blocks, n_kv_blocks, **scalars):\n"
            '    """The live (q block, key block) pairs in q-major order, as int32 tables (q block, key block,\n'
            "    flags: 1 = first key block of its q block, 2 = last, 4 = the mask cuts through the block). Every q\n"
            "    block keeps at least one pair so its\n"
            "    output is written (a row whose keys are all masked gives what the reference gives). Depends only on\n"
            '    shapes and static arguments, so it is computed once while tracing and lands in SMEM."""\n'
            "    q_ids, kv_ids, flags = [], [], []\n"
            "    with jax.ensure_compile_time_eval():\n"
            "        kv_blocks = jnp.arange(n_kv_blocks, dtype=jnp.int32)\n"
            "        for i in range(n_q_blocks):\n"
            f"            live, full, rows = jax.vmap(functools.partial({stem}_block_live, i, **scalars))(kv_blocks)\n"
            "            live, full = live.tolist(), full.tolist()\n"
            "            keep = [j for j, alive in enumerate(live) if alive] or [0]\n"
            + (
                "            if not bool(jnp.all(jnp.any(rows, axis=0))):  # a row with no live key: the finite fill\n"
                "                keep, full = list(range(n_kv_blocks)), [False] * n_kv_blocks  # averages them all\n"
                if self.finite_fill
                else ""
            )
            + "            for n, j in enumerate(keep):\n"
            "                q_ids.append(i)\n"
            "                kv_ids.append(j)\n"
            "                flags.append((n == 0) | (2 if n == len(keep) - 1 else 0) | (0 if full[j] else 4))\n"
            "        return tuple(jnp.asarray(t, jnp.int32) for t in (q_ids, kv_ids, flags))\n"
        )
        call_kw = ", ".join(f"{k}={self.kernel_kw[k]}" for k in names)
        step_axis = len(self.grid_dims())
        self.schedule = StepSchedule(
            prefetch=["q_ids", "kv_ids", "step_flags"],
            grid=[
                *((d.key, d.ext, "parallel") for d in self.grid_dims()),
                ("step", "q_ids.shape[0]", "arbitrary"),
            ],
            axis_code={
                self.q.axis: (f"q_ids_ref[pl.program_id({step_axis})]", "q_ids_ref[step_index]"),
                self.kv.axis: (f"kv_ids_ref[pl.program_id({step_axis})]", "kv_ids_ref[step_index]"),
            },
            wrapper_lines=[
                "# only the (q block, key block) pairs the mask leaves alive become grid steps",
                f"q_ids, kv_ids, step_flags = {stem}_schedule({self.q.padded} // {self.q.blk}, "
                f"{self.kv.padded} // {self.kv.blk}{', ' + call_kw if call_kw else ''})",
            ],
            defs=[live_fn, sched_fn],
        )
        self.step_axis = step_axis
        self.notes.append(
            "the grid walks only the (q block, key block) pairs the static mask leaves alive (tables built at "
            "trace time, scalar-prefetched): masked key blocks are neither fetched nor computed nor stepped over; "
            "the grid figures above are the dense logical grid"
        )
        return True

    def plan_static_conjunct(self, pred: Any) -> bool:
        """Schedule on the static half of `static & dynamic` (a causal mask ANDed with a same-segment mask
        read from segment ids): a pair the static half kills is dead whatever the operand says, so the
        grid skips it (no fetch, no compute, no step); the live pairs still apply the whole mask."""
        g = self.g
        p = g.producer.get(self.strip_layout(pred))
        if p is None or p not in set(self.region.eqns()) or g.eqns[p].primitive.name != "and":
            return False
        for w in g.eqns[p].invars:
            if not is_literal(w) and self.plan_schedule(w):
                self.notes.append(
                    "the mask's static half decides which (q block, key block) pairs are stepped over; the part "
                    "read from an operand is applied on every live pair (and skips the compute of blocks it "
                    "removes entirely, pl.when)"
                )
                return True
        return False

    def strip_layout(self, var: Any) -> Any:
        """The value under converts, broadcasts and reshapes computed in this region (same data per row)."""
        own = set(self.region.eqns())
        while not is_literal(var):
            p = self.g.producer.get(var)
            if p is None or p not in own or self.g.eqns[p].primitive.name not in LAYOUT_PRIMS:
                return var
            var = self.g.eqns[p].invars[0]
        return var

    def plan_length_clamp(self, pred: Any) -> bool:
        """Key blocks past a per-row length are not fetched: the K/V index maps clamp the key block to the
        row's last live one, read from a scalar-prefetched table, so the pipeline issues no new copy for
        them (the block index does not change); the mask's own `pl.when` skips their compute.

        Applies to a mask `key_position < length` (or `<=`) whose length is an operand indexed by one grid
        axis only (a sequence's length in decode or paged attention): the table is that operand, divided
        by the key block once in the wrapper.
        """
        g = self.g
        own = set(self.region.eqns())
        p = g.producer.get(self.strip_layout(pred))
        if p is None or p not in own or g.eqns[p].primitive.name not in ("lt", "le", "gt", "ge"):
            return False
        e = g.eqns[p]
        if any(is_literal(v) for v in e.invars):
            return False
        kv = self.ax.find(self.kv_class)
        sides = [{self.ax.find(c) for c in self.ax.footprint(v)} for v in e.invars]
        if sides[0] == {kv} and kv not in sides[1]:
            pos_side = 0
        elif sides[1] == {kv} and kv not in sides[0]:
            pos_side = 1
        else:
            return False
        bound = self.strip_layout(e.invars[1 - pos_side])
        if bound not in self.input_set or not str(bound.aval.dtype).startswith("int"):
            return False
        spanned = [d for d in self.dims if self.spans(bound, d)]
        if len(spanned) != 1 or spanned[0].role != "grid" or self.kv.axis is None:
            return False
        row = spanned[0]
        # live keys: pos < L (lt with pos left, gt with L left) or pos <= L (le / ge likewise)
        op = (
            e.primitive.name
            if pos_side == 0
            else {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}[e.primitive.name]
        )
        if op not in ("lt", "le"):
            return False
        extra = "" if op == "le" else " - 1"
        name = self.local(bound)
        grid = [
            (
                d.key,
                f"{d.padded} // {d.blk}" if d.role in ("tiled", "seq") else d.ext,
                "arbitrary" if d.role == "seq" else "parallel",
            )
            for d in sorted((d for d in self.dims if d.axis is not None), key=lambda d: d.axis)
        ]
        self.schedule = StepSchedule(
            prefetch=["kv_last"],
            grid=grid,
            axis_code={
                self.kv.axis: (
                    f"pl.program_id({self.kv.axis})",
                    f"jnp.minimum({self.kv.key}_index, kv_last_ref[{row.key}_index])",
                )
            },
            wrapper_lines=[
                "# the last key block each row needs: the K/V index maps stop there, so later blocks are not fetched",
                f"kv_last = jnp.clip((jnp.reshape({name}, (-1,)).astype(jnp.int32){extra}) // {self.kv.blk}, 0, "
                f"{self.kv.padded} // {self.kv.blk} - 1)",
            ],
        )
        self.notes.append(
            "key blocks past each row's length are neither fetched (the K/V index maps clamp to the last live "
            "block, from a scalar-prefetched table) nor computed (pl.when)"
        )
        return True

    def block_mask(self, var: Any, neutral: str) -> Any | None:
        """The predicate of a final `where(pred, x, neutral)` on the scores, if there is one: a key block
        where it is false everywhere contributes nothing (all -inf before a softmax, all 0 without)."""
        g = self.g
        own = set(self.region.eqns())
        while True:
            p = g.producer.get(var)
            if p is None or p not in own:
                return None
            e = g.eqns[p]
            if (
                neutral == "0"
                and e.primitive.name == "convert_element_type"
                and dtype_name(e.invars[0].aval) == "bool"
            ):
                return e.invars[0]  # x * float(pred): zero where the predicate is false
            if e.primitive.name in (
                "convert_element_type",
                "broadcast_in_dim",
                "reshape",
                "squeeze",
                "expand_dims",
                "transpose",
                "copy",
                "copy_p",
            ):
                var = e.invars[0]
                continue
            break
        info = self.region.attention
        if neutral == "0" and e.primitive.name == "exp":
            # exp(where(pred, x, -inf or a fill that underflows)) is exactly 0 where pred is false, whatever the
            # row holds (no softmax average over dead rows here)
            finite = self.finite_fill
            found = self.block_mask(e.invars[0], "-inf")
            self.finite_fill = finite
            return found
        if (
            neutral == "0"
            and e.primitive.name == "div"
            and info is not None
            and info.row_norm
            and e.outvars[0] is info.norm_div
            and _zero_preserving(g, info.sum_operand, info.norm_num, own)
        ):
            # num / den(l): zero where num is, and the row sum skips the same entries (its operand is zero there)
            return self.block_mask(e.invars[0], neutral)
        if e.primitive.name == "mul" and neutral == "0":  # x * where(pred, y, 0) (a decay mask)
            for w in e.invars:
                if not is_literal(w):
                    found = self.block_mask(w, neutral)
                    if found is not None:
                        return found
            return None
        if e.primitive.name != "select_n" or len(e.invars) != 3 or dtype_name(e.invars[0].aval) != "bool":
            return None
        fill = _constant_value(g, e.invars[1], own)
        if fill is None:
            return None
        if neutral == "-inf" and -math.inf < fill <= MASK_FILL_AS_NEG_INF:
            # a finite fill (-1e9, finfo.min) underflows exp to exactly 0 beside any live score, so a dead block
            # contributes nothing -- except to a row with no live key at all, which the reference averages
            # over every key: the static schedule keeps every block of such a q block (see plan_schedule)
            self.finite_fill = True
        elif fill != (-math.inf if neutral == "-inf" else 0.0):
            return None
        if not is_literal(e.invars[2]):
            self.mask_select = (e.outvars[0], e.invars[2])
        return e.invars[0]

    def title(self) -> str:
        info = self.region.attention
        assert info is not None
        n = len(info.score_dots)
        what = (
            "flash attention"
            if info.softmax
            else (
                "attention without softmax (decayed/linear)"
                if self.family == "linear_attention"
                else "two chained matmuls in one kernel (the hidden activation never leaves VMEM)"
            )
        )
        extra = op_summary(self.g, self.region, skip_dots=True, limit=6)
        return (
            f"{what}"
            + (f" ({n} score matmuls summed)" if n > 1 else "")
            + (f"; score/epilogue ops: {extra}" if extra else "")
        )

    def structure(self) -> str:
        info = self.region.attention
        assert info is not None
        if info.softmax:
            return (
                "grid (batch/heads, Q/bq, KV/bkv) with the key axis innermost and sequential; each step computes "
                "an (bq, bkv) score tile on the MXU, applies the score function (scale, masks) in VMEM, and "
                "updates a running row max m, row sum l and an f32 (bq, dv) accumulator (online softmax); the "
                "output is normalised and written once at the last key block"
            )
        return (
            "grid (batch/heads, Q/bq, KV/bkv) with the key axis innermost; each step computes an (bq, bkv) score "
            "tile, applies the elementwise score function (decay, masks) and accumulates probs @ v into an f32 "
            "VMEM accumulator"
        )

    def param_doc(self, d: SpaceDim) -> str:
        return "query rows per grid step" if d.key == "q" else "keys per grid step (the sequential axis)"

    def flops(self) -> float:
        info = self.region.attention
        assert info is not None
        total = 0.0
        for d in [*info.score_dots, info.pv_dot]:
            e = self.g.eqns[d]
            (lc, _), _ = e.params["dimension_numbers"]
            k = 1
            for a in lc:
                k *= int(e.invars[0].aval.shape[a])
            total += 2.0 * nelems(e.outvars[0]) * k
        return total

    def flops_code(self) -> str:
        rows = " * ".join(d.ext for d in [*self.grid_dims(), *self.rows_lead(), self.q] if d.classes) or "1"
        inner = " + ".join(d.ext for d in [*self.dq, self.dv] if d.classes) or "1"
        return f"2 * {rows} * n_kv * ({inner})"

    def transcendentals_code(self) -> str:
        info = self.region.attention
        rows = " * ".join(d.ext for d in [*self.grid_dims(), *self.rows_lead(), self.q] if d.classes) or "1"
        return f"{rows} * n_kv" if info is not None and info.softmax else "0"

    def temporaries(self) -> list[BufferSpec]:
        return [
            BufferSpec(
                what="score/probability tiles (~3 f32)",
                dims=self.tile_refs(self.score),
                itemsize=4,
                copies=3,
                kind="temporary",
            )
        ]
