"""(Batched) matmuls with a K loop into f32 VMEM accumulators and a fused epilogue."""

from __future__ import annotations

import math
import re
from typing import Any

from maxkernel.authors.offline.dataflow import is_literal, reduced_axes
from maxkernel.authors.offline.emit import dtype_code, dtype_name
from maxkernel.authors.offline.kernels import (
    LowerError,
    Scope,
    Space,
    SpaceDim,
    nelems,
    op_summary,
    precision_arg,
)
from maxkernel.authors.offline.spec import BufferSpec
from maxkernel.authors.offline.stream_reduce import StreamedReductions
from maxkernel.tools.estimate import F32_MXU_PASSES

EPILOGUE_CHUNK_BYTES = 2 * 1024 * 1024
"""f32 bytes of one row chunk of a whole-row epilogue (`MatmulBuilder.epilogue_chunk`)."""

EPILOGUE_MIN_ROWS = 32
"""Fewest rows in such a chunk: a whole sublane tile of every dtype (8 rows of 32-bit, 16 of 16-bit, 32 of
8-bit), so each chunk's loads and stores stay aligned."""


class MatmulBuilder(StreamedReductions):
    """(Batched) matmul with a K loop into f32 VMEM accumulators and a fused epilogue."""

    family = "matmul"
    chunked_rows: int | None = None
    """Rows per chunk of the epilogue once `row_chunked` has wrapped it (None: the whole tile at once)."""

    def make_space(self) -> None:
        g, ax = self.g, self.ax
        dots = [g.eqns[d] for d in self.region.dots]
        e0 = dots[0]
        (lc, rc), (lb, rb) = e0.params["dimension_numbers"]
        lhs, rhs = e0.invars
        out = e0.outvars[0]
        batch = [ax.cls(lhs, d) for d in lb]
        mcls = [ax.cls(lhs, d) for d in range(len(lhs.aval.shape)) if d not in lc and d not in lb]
        ncls = [ax.cls(rhs, d) for d in range(len(rhs.aval.shape)) if d not in rc and d not in rb]
        batch = [c for c in batch if c is not None]
        mcls = [c for c in mcls if c is not None]
        ncls = [c for c in ncls if c is not None]
        for e in dots[1:]:
            (lc2, rc2), (lb2, rb2) = e.params["dimension_numbers"]
            b2 = {ax.cls(e.invars[0], d) for d in lb2} - {None}
            m2 = {
                ax.cls(e.invars[0], d)
                for d in range(len(e.invars[0].aval.shape))
                if d not in lc2 and d not in lb2
            } - {None}
            n2 = {
                ax.cls(e.invars[1], d)
                for d in range(len(e.invars[1].aval.shape))
                if d not in rc2 and d not in rb2
            } - {None}
            if b2 != set(batch) or m2 != set(mcls) or n2 != set(ncls):
                raise LowerError("the dots of a fused matmul do not share their output axes the same way")
        del out
        dims: list[SpaceDim] = []
        for k, c in enumerate(batch):
            dims.append(SpaceDim(key=f"b{k}" if len(batch) > 1 else "b", classes=[c], role="grid"))
        # N is whole in a tile when the epilogue reduces along it, unless it is too long (region.stream): then
        # it is walked in blocks as a sequential axis, outside K, with the reductions kept online. An epilogue
        # that reduces along M (a column sum) walks M that way instead, N tiled outside it.
        self.stream = self.region.stream
        self.stream_rows = self.stream and self._reduces_rows(set(mcls))
        self.m = SpaceDim(
            key="m", classes=mcls, role="seq" if self.stream_rows else "tiled", param=f"{self.cprefix}BLOCK_M"
        )
        n_full = self.region.has_reduction and not self.stream
        self.n = SpaceDim(
            key="n",
            classes=ncls,
            role="full" if n_full else "seq" if self.stream and not self.stream_rows else "tiled",
            param=None if n_full else f"{self.cprefix}BLOCK_N",
        )
        dims += [self.m, self.n]
        self.ks: list[SpaceDim] = []
        for e in dots:
            (lci, _), _ = e.params["dimension_numbers"]
            kc = [ax.cls(e.invars[0], d) for d in lci]
            kc = [c for c in kc if c is not None]
            same = next((k for k in self.ks if k.classes == kc), None)
            if same is None:
                n = len({id(k) for k in self.ks})
                same = SpaceDim(
                    key="k" if n == 0 else f"k{n}", classes=kc, role="seq", param=f"{self.cprefix}BLOCK_K"
                )
            self.ks.append(same)
        for k in dict.fromkeys(self.ks):
            dims.append(k)
        axis = 0
        for d in dims:
            if d.role in ("grid", "tiled"):
                d.axis = axis
                axis += 1
        if self.stream:
            self.walked.axis = axis
            axis += 1
        self.k_axis = axis
        for k in self.ks:
            k.axis = axis
        self.dims = dims
        self.epi = Space("epi", [self.m, self.n])
        if n_full:
            self.family = "matmul_rowreduce"
            self.stem = self.stem.replace("_matmul", "_matmul_rowreduce")
        elif self.stream_rows:
            self.family = "matmul_colreduce"
            self.stem = self.stem.replace("_matmul", "_matmul_colreduce")
        elif self.stream:
            self.family = "matmul_online_reduce"
            self.stem = self.stem.replace("_matmul", "_matmul_online_reduce")
        if len(dots) > 1:
            reducing = self.region.has_reduction
            self.family = "gated_matmul" if not reducing else self.family
            self.stem = self.stem.replace("_matmul", "_gated_matmul") if not reducing else self.stem

    def _reduces_rows(self, mcls: set[Any]) -> bool:
        """Do the epilogue's reductions run along M (the output rows)? Partition lets a matmul region reduce
        along M or along N, never both."""
        ax = self.ax
        for i in self.region.owned:
            if self.g.kind[i] == "reduce":
                e = self.g.eqns[i]
                return bool(mcls) and {ax.cls(e.invars[0], d) for d in reduced_axes(e)} - {None} == mcls
        return False

    @property
    def walked(self) -> SpaceDim:
        """The output dim a streamed epilogue reduces along (a sequential grid axis outside K)."""
        return self.m if self.stream_rows else self.n

    def out_space(self) -> Space:
        return self.epi

    def overhang_ok(self, d: SpaceDim) -> bool:
        # rows of the lhs and columns of the rhs past the edge only reach output rows/columns past the edge
        # (a walked M's or N's reductions mask them with `valid`); K needs real zeros (the accumulator sums
        # along it), which the body writes over the overhanging part of both operands' last K block
        # (`mask_k_tail`) instead of a padded copy of both operands in HBM
        return (
            d.role == "tiled"
            or d is self.n
            or d is self.m
            or any(d is k and self.k_masked(k) for k in self.ks)
        )

    def scratch(self) -> list[tuple[str, str, list[SpaceDim | str]]]:
        accs: list[tuple[str, str, list[SpaceDim | str]]] = [
            (f"acc{i}_ref" if len(self.region.dots) > 1 else "acc_ref", "jnp.float32", [self.m, self.n])
            for i in range(len(self.region.dots))
        ]
        if self.stream:
            accs += self.stream_scratch(self.epi, "red")
        return accs

    def make_body(self) -> list[str]:
        g = self.g
        main = Scope(lines=[], indent="    ")
        k_index = self.program_id(self.k_axis)
        accs = [s[0] for s in self.scratch()][: len(self.region.dots)]
        main.add(f"@pl.when({k_index} == 0)")
        main.add("def _init():")
        for a in accs:
            main.add(f"    {a}[...] = jnp.zeros_like({a})")
        main.add("")
        for i, d in enumerate(self.region.dots):
            e = g.eqns[d]
            lhs_space = Space(f"lhs_{self.ks[i].key}", [self.m, self.ks[i]])
            rhs_space = Space(f"rhs_{self.ks[i].key}", [self.ks[i], self.n])
            lhs, rhs = e.invars[0], e.invars[1]
            prec = precision_arg(e)
            exact = [self.bf16_source(lhs), self.bf16_source(rhs)]
            if exact[0] is not None and exact[1] is not None:
                # f32 upcasts of bf16 values: bf16 x bf16 products are exact in f32, so one bf16 MXU pass
                # with f32 accumulation computes the same dot as any f32 precision (HIGHEST included)
                lhs, rhs = exact[0], exact[1]
                prec = ""
            nt = self.rhs_transposed(rhs, i)
            if nt:
                rhs_space = Space(f"rhsT_{self.ks[i].key}", [self.n, self.ks[i]])
            a, am = self.value(lhs, lhs_space, main)
            b, bm = self.value(rhs, rhs_space, main)
            a, _ = self.materialise(
                a,
                am,
                {self.m.key, self.ks[i].key} if self.m.classes else {self.ks[i].key},
                lhs_space,
                main,
                dtype_name(lhs.aval),
            )
            b, _ = self.materialise(
                b,
                bm,
                {self.ks[i].key, self.n.key} if self.n.classes else {self.ks[i].key},
                rhs_space,
                main,
                dtype_name(rhs.aval),
            )
            if dtype_name(e.outvars[0].aval).startswith("int"):
                raise LowerError("integer matmuls are not supported")
            a, b = self.mask_k_tail(a, b, self.ks[i], k_index, main, rhs_k_last=nt)
            if nt:  # the weight as it is in HBM, [N, K]: the MXU takes it transposed, no copy outside
                dims = "(((1,), (1,)), ((), ()))"
                main.add(
                    f"{accs[i]}[...] += lax.dot_general({a}, {b}, {dims}, preferred_element_type=jnp.float32{prec})"
                )
            else:
                main.add(f"{accs[i]}[...] += jnp.dot({a}, {b}, preferred_element_type=jnp.float32{prec})")
        main.add("")
        main.add(f"@pl.when({k_index} == pl.num_programs({self.k_axis}) - 1)")
        main.add("def _epilogue():")
        epi = Scope(lines=[], indent="        ")
        for i, d in enumerate(self.region.dots):
            out = g.eqns[d].outvars[0]
            dt = dtype_name(out.aval)
            acc = accs[i]

            def load_acc(
                scope: Scope, space: Space, acc: str = acc, dt: str = dt
            ) -> tuple[str, frozenset[str]]:
                nm = self.fresh("acc")
                mat = frozenset(k for k in (self.m.key, self.n.key))
                cast = "" if dt == "float32" else f".astype({dtype_code(dt)})"
                scope.add(f"{nm} = {acc}[...]{cast}" + self.comment(dt, space, mat))
                return nm, mat

            epi.special[out] = load_acc
        names = ["out"] if len(self.outputs) == 1 else [f"out{i}" for i in range(len(self.outputs))]
        if self.stream:
            return main.lines + self.streamed_body(epi, self.epi, self.walked, names, "red")
        for v, nm in zip(self.outputs, names, strict=True):
            self.store(v, f"{nm}_ref", self.epi, epi)
        return main.lines + self.row_chunked(epi.lines, accs, names)

    def epilogue_chunk(self) -> int | None:
        """Rows the epilogue of a tile that holds whole output rows (`matmul_rowreduce`) works on at a time.

        Its values are [bm, N] (or [bm, 1], [1, N]): row by row independent, and Mosaic keeps each live one
        in VMEM. Over a whole 256 x 8192 tile that was ~2 f32 tiles of temporaries (16 MiB) beside the
        accumulator and the output block, which held the row block at 256 rows, and a 4096 x 8192 x 8192
        linear + softmax re-read its 128 MiB weight once per row block (2.1 GiB, HBM-bound on v6e at 0.61x
        of XLA, block model). In chunks of rows whose f32 values take ~2 MiB, the temporaries shrink to a
        chunk's and the row block can grow. None: no chunking (no row axis, a short tile)."""
        if self.family != "matmul_rowreduce" or not self.m.classes:
            return None
        n = max(self.group_extent(self.n), 1)
        lanes = -(-n // 128) * 128
        rows = 512
        while rows > EPILOGUE_MIN_ROWS and rows * lanes * 4 > EPILOGUE_CHUNK_BYTES:
            rows //= 2
        return rows

    def row_chunked(self, lines: list[str], accs: list[str], names: list[str]) -> list[str]:
        """The epilogue's lines run through `_row_chunks` over the refs whose block spans the output rows
        (the accumulators, the row outputs, the row inputs), each bound to a chunk of rows. Left whole where
        a line depends on the row position (an iota, a program id: the chunk's offset would be missing)."""
        chunk = self.epilogue_chunk()
        text = "\n".join(lines)
        if chunk is None or "iota" in text or "_index" in text or "program_id" in text:
            return lines
        refs = list(accs)
        refs += [f"{nm}_ref" for v, nm in zip(self.outputs, names, strict=True) if self.spans(v, self.m)]
        for v in self.input_set:
            view = self.input_view.get(v)
            if (
                view is not None
                and [d.key for d in view[-2:]] == [self.m.key, self.n.key]
                and self.spans(v, self.m)
            ):
                refs.append(f"{self.local(v)}_ref")
        refs = [r for r in dict.fromkeys(refs) if re.search(rf"\b{r}\b", text)]
        if not refs:
            return lines
        self.chunked_rows = chunk
        out = [f"        def _epilogue_rows({', '.join(refs)}):"]
        out += ["    " + line for line in lines]
        out.append(f"        _row_chunks(_epilogue_rows, {chunk}, {', '.join(refs)})")
        return out

    def k_masked(self, k: SpaceDim) -> bool:
        """Does this K get the in-kernel tail mask (`mask_k_tail`) instead of a zero-padded copy in HBM?

        Decided once from every traced shape, never at run time: the harness requires one program at the
        validation and the task's own shapes, and a K that is a lane multiple everywhere keeps the plain
        body (a lane-aligned K that still does not divide its block is padded as before)."""
        extents = zip(*(self.ax.extents_all(c) for c in k.classes), strict=True) if k.classes else [()]
        return any(math.prod(e) % 128 for e in extents)

    def rhs_transposed(self, rhs: Any, i: int) -> bool:
        """Is the dot's right operand an input laid out [N, K] in HBM (`x @ w.T` with a PyTorch-style weight of
        [out_features, in_features])? The kernel then reads its blocks as they are and contracts their last dims
        (an NT matmul, which the MXU does without a copy); the wrapper used to transpose the whole weight in HBM
        first (a 8192 x 8192 f32 weight: 537 MB of glue, 0.73 ms on v5e by the block model)."""
        g = self.g
        var = rhs
        own = set(self.region.eqns())
        while var not in self.input_set:
            p = g.producer.get(var)
            if p is None or p not in own or is_literal(var):
                return False
            e = g.eqns[p]
            if g.kind[p] != "absorbed" or e.primitive.name in ("convert_element_type", "iota"):
                return False
            if e.primitive.name not in ("transpose", "reshape", "squeeze", "expand_dims", "broadcast_in_dim"):
                return False
            var = e.invars[0]
        present = [c for c in self.ax.classes(var) if c is not None]
        n_cls = [self.ax.find(c) for c in self.n.classes]
        k_cls = [self.ax.find(c) for c in self.ks[i].classes]
        if not n_cls or not k_cls:
            return False
        return [self.ax.find(c) for c in present] == [*n_cls, *k_cls]

    def mask_k_tail(
        self, a: str, b: str, k: SpaceDim, k_index: str, scope: Scope, rhs_k_last: bool = False
    ) -> tuple[str, str]:
        """Zero both operands past the end of K, so the last K block may overhang the array edge.

        Pallas fills the overhang with unspecified values (NaN or Inf among them, so masking one side alone
        is not enough: 0 x NaN is NaN). Padding K with zeros outside instead is a whole copy of both
        operands in HBM (a 4000 x 5000 by 5000 x 10000 f32 product: 624 MB, 0.85 ms on v5e per the block
        model) for the sake of 120 columns. Where K fits one block the mask keeps everything."""
        if not self.k_masked(k):
            return a, b
        n_k = self.kw(k.ext, k.ext)
        bk = self.kw(k.blk, k.blk)
        a_m, b_m = self.fresh("lhs_masked"), self.fresh("rhs_masked")
        scope.add("# K does not divide its block everywhere: zero both operands past its end (no pad in HBM)")
        scope.add(f"k_lanes = {k_index} * {bk} + lax.broadcasted_iota(jnp.int32, (1, {bk}), 1)")
        scope.add(f"k_rows = {k_index} * {bk} + lax.broadcasted_iota(jnp.int32, ({bk}, 1), 0)")
        scope.add(f"{a_m} = jnp.where(k_lanes < {n_k}, {a}, jnp.zeros_like({a}))")
        scope.add(
            f"{b_m} = jnp.where({'k_lanes' if rhs_k_last else 'k_rows'} < {n_k}, {b}, jnp.zeros_like({b}))"
        )
        return a_m, b_m

    def bf16_source(self, var: Any) -> Any | None:
        """The bf16 value behind an in-kernel f32 upcast that feeds a dot (None when there is none)."""
        p = self.g.producer.get(var)
        if p is None or p not in set(self.region.eqns()) or var in self.input_set:
            return None
        e = self.g.eqns[p]
        if e.primitive.name != "convert_element_type" or is_literal(e.invars[0]):
            return None
        if dtype_name(e.invars[0].aval) != "bfloat16" or dtype_name(var.aval) != "float32":
            return None
        return e.invars[0]

    def title(self) -> str:
        g = self.g
        n = len(self.region.dots)
        e = g.eqns[self.region.dots[0]]
        base = "batched matmul" if e.params["dimension_numbers"][1][0] else "matmul"
        if n > 1:
            base = f"{n} matmuls sharing a K loop"
        ops = op_summary(g, self.region, skip_dots=True)
        return base + (f" with epilogue: {ops}" if ops else "")

    def structure(self) -> str:
        s = (
            "grid (batch, M/bm, N/bn, K/bk) with K innermost and sequential; each step multiplies an (bm, bk) "
            "block by a (bk, bn) block on the MXU and adds into an f32 VMEM accumulator; the epilogue runs once "
            "per output tile at the last K step, so it costs no extra HBM traffic"
        )
        if self.stream_rows:
            s += (
                "; the epilogue reduces along M (the output rows), so M is a sequential grid axis inside N and "
                "outside K: each (bm, bn) tile is folded into f32 (1, bn) accumulators in VMEM at its last K "
                "step (rows past the end masked) and the finishing ops run at the last M block, so the [M, N] "
                "product never goes to HBM"
            )
        elif self.stream:
            s += (
                "; the epilogue reduces along an N too long for one tile, so N is a sequential grid axis outside K: "
                "each (bm, bn) logit tile is folded into f32 (bm, 1) accumulators in VMEM at its last K step "
                "(a max and a sum of exp(x - max) kept online, rescaled whenever the running max grows) and the "
                "finishing ops run at the last N block, so the [M, N] product never goes to HBM"
            )
        elif self.region.has_reduction:
            s += "; N is whole in each tile because the epilogue reduces along it"
        if len(self.region.dots) > 1:
            s += f"; {len(self.region.dots)} accumulators share the K loop (one per dot)"
        return s

    def param_doc(self, d: SpaceDim) -> str:
        if d is self.walked and self.stream:
            what = "rows (M)" if d is self.m else "columns (N)"
            return f"{what} per grid step (the sequential axis the epilogue reduces along)"
        return {"m": "rows of the output tile (M)", "n": "columns of the output tile (N)"}.get(
            d.key, "contraction block (K) per grid step"
        )

    def flops(self) -> float:
        total = 0.0
        for d in self.region.dots:
            e = self.g.eqns[d]
            (lc, _), _ = e.params["dimension_numbers"]
            k = 1
            for a in lc:
                k *= int(e.invars[0].aval.shape[a])
            total += 2.0 * nelems(e.outvars[0]) * k
        return total

    def mxu_passes(self) -> int:
        """Six for an f32 dot at HIGHEST (Mosaic's bf16_6x), one otherwise: the same rule the dots' emitted
        precision follows (bf16 values upcast to f32 run one exact bf16 pass)."""
        worst = 1
        for d in self.region.dots:
            e = self.g.eqns[d]
            exact = self.bf16_source(e.invars[0]) is not None and self.bf16_source(e.invars[1]) is not None
            if precision_arg(e) and not exact:
                worst = max(worst, F32_MXU_PASSES["highest"])
        return worst

    def flops_code(self) -> str:
        per = " * ".join(d.ext for d in [*self.grid_dims(), self.m, self.n] if d.classes) or "1"
        terms = [f"2 * {per} * {k.ext}" for k in self.ks]  # one term per dot
        return " + ".join(terms)

    def transcendentals_code(self) -> str:
        n = int(self.transcendentals)
        per = " * ".join(d.ext for d in [*self.grid_dims(), self.m, self.n] if d.classes) or "1"
        return f"{n} * {per}" if n else "0"

    def temporaries(self) -> list[BufferSpec]:
        dims = self.tile_refs(self.epi)
        chunk = self.chunked_rows
        if chunk:
            dims[0] = dims[0].model_copy(update={"chunk": chunk})
        out = [
            BufferSpec(
                what=f"epilogue f32 temporaries (~{3 if self.stream else 2} tiles"
                + (f" of {chunk}-row chunks)" if chunk else ")"),
                dims=dims,
                itemsize=4,
                copies=3 if self.stream else 2,
                kind="temporary",
            )
        ]
        if self.mxu_passes() > 1:
            # Mosaic's six-pass f32 dot splits each operand block into bf16 parts in scoped VMEM: measured
            # (v5e/v6e AOT, libtpu 0.0.42.1) 61.2 MiB scoped for a 1000 x 2048 by 2048 x 512 HIGHEST block
            # pair whose blocks, accumulator and epilogue tiles come to ~33.5 MiB, i.e. ~2.4x the two operand
            # blocks on top; counted as three bf16 copies plus one f32 copy (2.5x). Mosaic's own room: it
            # raises vmem_limit_bytes, the tile budget (half the VMEM) already leaves space for it
            for k in dict.fromkeys(self.ks):
                for space in (Space("lhs", [self.m, k]), Space("rhs", [k, self.n])):
                    dims = self.tile_refs(space)
                    out.append(
                        BufferSpec(
                            what=f"bf16 parts of the f32 {space.key} block (HIGHEST)",
                            dims=dims,
                            itemsize=2,
                            copies=3,
                            kind="compiler",
                        )
                    )
                    out.append(
                        BufferSpec(
                            what=f"f32 remainder of the {space.key} block (HIGHEST)",
                            dims=dims,
                            itemsize=4,
                            copies=1,
                            kind="compiler",
                        )
                    )
        return out
