"""A stride-1 convolution (2-D or 3-D, any padding) as a sum of shifted matmuls inside one kernel.

No im2col array: each grid step fetches a halo'd block of the padded input, the `rows + k - 1` rows (planes,
for 3-D) that its `rows` output rows read. Consecutive blocks overlap by the halo, which a blocked index map
cannot say, so the input's BlockSpec uses element offsets (`pl.Element` on every dim; the index map returns
`r_index * rows`). For every kernel tap the kernel reads the shifted window `x[kr : kr + rows, kw : kw +
W_out, :]` of that block, flattens it to `(rows * W_out, C_in)` and multiplies it by the tap's
`(C_in, block_o)` weights on the MXU into an f32 accumulator. Each step writes a block of output rows
(`BLOCK_ROWS` along the first spatial dim) for a block of output channels (`BLOCK_O`). HBM traffic is the
input once (plus (k-1)/rows for the halo, plus XLA's padded copy) and the output once, where im2col writes
and reads `taps` copies of the input.

XLA's padded copy (the conv's own zero padding plus whole row blocks) is still made in HBM, a read and a
write of the input before the kernel (7-18% of the block model's time on the suite's convs). An element-offset
block may read past the array's end (`pl.Element(n, padding=(0, high))` compiles for v5e and v6e), but Mosaic
(libtpu 0.0.42.1) rejects low padding ("Low padding not supported yet"), which SAME needs at the top and
left, and the padded part of a block is undefined (TPU interpret mode fills it with uninitialised values):
absorbing the pad means zeroing the halo in VMEM, e.g. while a depthwise conv stages its block in f32.

The output width is padded to the sublane tile so the flattening is a free relayout; the extra columns
read zero padding and are cropped. Strided, dilated and grouped convolutions keep the im2col path.

When the input channels do not fill the MXU's depth (`MXU_DEPTHS`: 128 on v5e and before, 256 on v6e and
7x), the taps of the trailing spatial dims are placed side by side along the channels in VMEM
(`jnp.concatenate` of their windows, an im2col that never leaves VMEM) and contracted in one matmul of
depth `taps * C_in` against the weights reshaped to match (`merged_dims` picks how many dims: the least
padded depth over both MXU depths): a 96-channel 3x3 conv pads each 96-deep tap matmul to 128 / 256 (9 x
128 = 1152 / 9 x 256 = 2304 of depth), all nine taps side by side pad 864 to 896 / 1024.

When the output channels leave most of the MXU's width idle (64 channels: half of v5e's 128-wide MXU, a
quarter of v6e's 256), `lane_pack` may put `pack` adjacent output columns side by side along the lanes: the
input is reshaped `(..., W, C_in) -> (..., W / pack, pack * C_in)` (free in HBM), the W taps then come in
groups of `pack` input columns, and the weights become a block-banded `(groups * pack * C_in, pack * C_out)`
matrix (column p of a packed row takes input column q of group j through tap `j * pack + q - p`). Each matmul
row yields `pack` columns; the epilogue and its spatial reductions work on the packed rows (the mask of padded
columns reads the column from the lane), and the wrapper folds the `pack` partial reductions and reshapes
the output back for free. A reduction over the channels (a softmax) reduces each column's lane group and
broadcasts it back over the group; a pool takes packing only when its W window is the packing (the window
is then a max or sum across a row's lane groups, and the pooled block comes out unpacked).

A depthwise conv (one filter per channel) runs on the VPU; a bf16 one converts its block to f32 once per
step into VMEM scratch instead of converting each tap's window. Elementwise epilogues, spatial and channel
reductions (conv_epilogue.py) and pools (conv_pool.py) run on the f32 accumulator before the one store.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from maxkernel.authors.offline.conv_chw import build_chw, chw_ok
from maxkernel.authors.offline.conv_epilogue import SPATIAL_REDUCTIONS, build_epilogue, conv_out_of, view_perm
from maxkernel.authors.offline.conv_pool import pooled_shape
from maxkernel.authors.offline.emit import EmitError, dtype_code, dtype_name, transpose_code
from maxkernel.authors.offline.kernels import SUBLANE, KernelBuilder, LowerError, nbytes
from maxkernel.authors.offline.spec import BufferSpec, DimRef, GridAxis, KernelSpec, ParamSpec
from maxkernel.authors.offline.trace import direct_conv_ok, is_depthwise

if TYPE_CHECKING:
    from maxkernel.authors.offline.lower import Lowering
    from maxkernel.authors.offline.partition import Region


MXU_DEPTH = 256
"""The deepest MXU contraction among the target generations (v6e, 7x); a tap matmul whose depth (C_in) is
not a multiple of it runs part of the systolic array idle on those chips."""

MXU_DEPTHS = (128, 256)
"""Contraction depths of the target MXUs (v5e and before: 128; v6e, 7x: 256). The merge depth is chosen for
all of them at once: one kernel source serves every generation."""

MERGE_MIN_GAIN = 0.05
"""Least fraction of padded MXU depth a deeper tap merge must remove to be worth its wider VMEM copy."""

MERGED_PLANE_BYTES = 12 << 20
"""Cap on the per-plane im2col temporary of a 3-D conv (one output plane's windows side by side). A 2-D
conv's temporary grows with its row block, which the tuner sizes against the VMEM budget instead."""


def padded_depth(c_in: int, ksz: tuple[int, ...], merged: int, mxu: int) -> int:
    """MXU depth the taps cost when the last `merged` spatial dims' taps are contracted side by side: one
    matmul per remaining tap, each `prod(merged taps) * C_in` deep, padded up to the MXU's depth."""
    inner = math.prod(ksz[len(ksz) - merged :]) * c_in
    return math.prod(ksz[: len(ksz) - merged]) * (-(-inner // mxu) * mxu)


def merged_dims(c_in: int, ksz: tuple[int, ...], depthwise: bool, plane_bytes: int = 0) -> int:
    """How many trailing spatial dims' taps to place side by side along the channels in VMEM (0: one
    C_in-deep matmul per tap). Each merge removes MXU depth padding (a 96-channel 3x3 conv: 9 x 128 = 1152
    on v5e and 9 x 256 = 2304 on v6e per tap, 3 x 384 / 3 x 512 for its W taps, 896 / 1024 for all nine
    taps at once) at the price of copying the windows side by side (VPU/VMEM work, no HBM). A deeper merge
    is taken when it cuts the padded depth summed over the target MXUs by at least `MERGE_MIN_GAIN` (a
    320-channel conv gains 2% from nine taps over three, less than the wider copy costs on v6e); for a 3-D
    conv (`plane_bytes`: one output plane's window bytes per channel of depth) the temporary must also fit."""
    if depthwise:
        return 0
    best = 0
    cost = [sum(padded_depth(c_in, ksz, m, d) for d in MXU_DEPTHS) for m in range(len(ksz) + 1)]
    for m in range(1, len(ksz) + 1):
        if plane_bytes and m > 1 and plane_bytes * math.prod(ksz[len(ksz) - m :]) * c_in > MERGED_PLANE_BYTES:
            break
        if cost[m] <= (1.0 - MERGE_MIN_GAIN) * cost[best]:
            best = m
    return best


LANE_PACKS = (1, 2, 4)
"""How many adjacent output columns one matmul row may hold (see `lane_pack`)."""


def packed_taps(ksz: tuple[int, ...], pack: int) -> tuple[int, ...]:
    """Kernel sizes with the last dim's taps in groups of `pack` input columns: `pack` adjacent outputs read
    `pack + k - 1` columns, i.e. ceil((pack + k - 1) / pack) groups of the packed input."""
    return (*ksz[:-1], -(-(pack + ksz[-1] - 1) // pack))


def lane_pack(
    c_in: int,
    c_out: int,
    ksz: tuple[int, ...],
    depthwise: bool,
    plane_bytes: int = 0,
    choices: tuple[int, ...] = LANE_PACKS,
) -> tuple[int, int]:
    """(pack, merged dims): how many adjacent output columns to compute side by side in one matmul row, and
    the tap merge (`merged_dims`) at that packing.

    A conv with few output channels leaves most of the MXU's width idle: 64 channels use half of a 128-wide
    MXU (v5e) and a quarter of a 256-wide one (v6e), and its epilogue half-empty vregs. Reshaping the input
    `(..., W, C_in) -> (..., W / pack, pack * C_in)` (free in HBM) and the weights into a block-banded
    `(taps * pack * C_in, pack * C_out)` matrix makes each matmul row produce `pack` columns at once: N grows
    `pack`-fold, the contraction by (pack + k - 1) / k per row of taps. Taken when it lowers the padded MXU
    work summed over the target MXUs by at least `MERGE_MIN_GAIN` and raises it on none (one source serves
    every generation: 64 -> 128 channels is 1.7x less work on v5e and 2x on v6e for a 64-channel 3x3 conv; a
    128-channel conv packed to 256 would be 2x better on v6e but 1.2x worse on v5e, so it stays unpacked).
    `choices`: the packings the epilogue allows (a pool over W needs its window to be the packing)."""
    base_merge = merged_dims(c_in, ksz, depthwise, plane_bytes)
    if depthwise:
        return 1, base_merge

    def work(pack: int, merged: int) -> list[float]:
        """Padded MXU work per output pixel on each target MXU (square: depth d, width d)."""
        kp = packed_taps(ksz, pack)
        return [
            padded_depth(pack * c_in, kp, merged, d) * (-(-pack * c_out // d) * d) / pack for d in MXU_DEPTHS
        ]

    base = work(1, base_merge)
    best, best_merge, best_cost = 1, base_merge, sum(base)
    for pack in sorted(set(choices) - {1}):
        if pack * c_out > max(MXU_DEPTHS):
            break
        merged = merged_dims(pack * c_in, packed_taps(ksz, pack), depthwise, plane_bytes // pack)
        cost = work(pack, merged)
        if (
            all(c <= b for c, b in zip(cost, base, strict=True))
            and sum(cost) <= (1.0 - MERGE_MIN_GAIN) * best_cost
        ):
            best, best_merge, best_cost = pack, merged, sum(cost)
    return best, best_merge


class ConvBuilder(KernelBuilder):
    family = "conv"

    def __init__(self, low: Lowering, region: Region, index: int, n_kernels: int) -> None:
        super().__init__(low, region, index, n_kernels)
        self.eqn = self.g.eqns[min(region.owned)]

    def build(self) -> tuple[KernelSpec, str]:
        e = self.eqn
        p = e.params
        x, w = e.invars
        outs = self.outputs
        n_extra = len([v for v in self.inputs if v not in e.invars])
        try:
            ep = build_epilogue(self, e, [f"e{k}_ref" for k in range(n_extra)])
        except EmitError as exc:
            raise LowerError(str(exc)) from exc
        if any(r is None for r in ep.results) != bool(ep.reductions):
            raise LowerError("a spatial reduction of the conv region that is not its output")
        reduced = bool(ep.reductions)
        batch_reduced = ep.batch_reduced
        # grid positions of the batch, row and channel-block axes: a reduction accumulates over the row axis
        # (and over the batch axis too when it sums the batch), so those go last, as "arbitrary" dims must
        if batch_reduced:
            grid_args, (ax_n, ax_r, ax_o) = "o_index, n_index, r_index", (1, 2, 0)
        elif reduced:
            grid_args, (ax_n, ax_r, ax_o) = "n_index, o_index, r_index", (0, 2, 1)
        else:
            grid_args, (ax_n, ax_r, ax_o) = "n_index, r_index, o_index", (0, 1, 2)
        out_refs = [f"o{k}_ref" for k in range(len(outs))]
        # a pool fused after the conv (conv_pool): those outputs are the pooled blocks; a 3-D conv's depth
        # window is combined across the planes of its block in the plane loop's carry
        pool_windows = tuple(ep.pool_windows or (1,) * (len(e.invars[0].aval.shape) - 2))
        ph, pw = pool_windows[-2:]
        pooled_to = pooled_shape(conv_out_of(e), pool_windows) if ep.pool_windows else None
        is_pooled = [tuple(int(d) for d in v.aval.shape) == pooled_to for v in outs]
        dn = p["dimension_numbers"]
        lhs_spec, rhs_spec, out_spec = tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec)
        nsp = len(lhs_spec) - 2
        if not direct_conv_ok(
            p, tuple(int(s) for s in x.aval.shape), x.aval.dtype.itemsize, tuple(int(s) for s in w.aval.shape)
        ):
            raise LowerError("a convolution the direct kernel does not cover")
        depthwise = is_depthwise(p, tuple(int(s) for s in x.aval.shape), tuple(int(s) for s in w.aval.shape))
        s, c = self.stem, self.cprefix
        xn, wn = self.low.name_of(x), self.low.name_of(w)
        xdt = dtype_name(x.aval)
        sub = SUBLANE.get(x.aval.dtype.itemsize, 8)
        prec = p.get("precision")
        names = {
            getattr(q, "name", str(q)) for q in (prec if isinstance(prec, tuple | list) else (prec,)) if q
        }
        prec_code = ", precision=lax.Precision.HIGHEST" if "HIGHEST" in names and xdt == "float32" else ""
        if chw_ok(self, e, ep, depthwise):  # PyTorch-layout data: no transposes around the kernel
            return build_chw(self, e, ep, prec_code)
        # per-configuration padding, as code over the kernel sizes where it depends on them
        pads = [tuple(int(a) for a in pp) for pp in p["padding"]]
        if any(
            [tuple(int(a) for a in pp) for pp in a.params["padding"]] != pads
            for a in self.low.traces.aligned_eqns(e)
        ):
            raise LowerError("a convolution whose padding changes with the input shapes")
        sp = "".join("dhw"[3 - nsp + i] for i in range(nsp))  # spatial letters: "hw" or "dhw"
        to_cl = (lhs_spec[0], *lhs_spec[2:], lhs_spec[1])
        w_perm = (*rhs_spec[2:], rhs_spec[1], rhs_spec[0])
        from_cl = [0] * (nsp + 2)  # channels-last output -> the reference's layout
        cl_axes = [out_spec[0], *out_spec[2:], out_spec[1]]
        for j, ax in enumerate(cl_axes):
            from_cl[ax] = j
        lead = sp[0]
        # 2-D: one matmul per tap over the whole block of rows. 3-D: a loop over the block's output planes,
        # each plane an (H_out * W_out, C_in) matmul per tap, so vector sizes (and compile time) do not grow
        # with the block.
        per_plane = nsp == 3
        pad = "    " * (2 if per_plane else 1)
        # taps of the merged trailing dims (see `merged_dims`) are unrolled and their windows concatenated
        # along the channels: one matmul of depth prod(merged taps) * C_in. Taps along the other dims run in
        # fori_loops (dynamic offsets on leading dims are free) so the kernel's code (and the Mosaic compile
        # time) stays that of one tap row; with no merge, the last dim's taps (which shift the sublane axis)
        # are unrolled, one C_in-deep matmul each.
        last = sp[-1]
        c_in_x = int(x.aval.shape[lhs_spec[1]])
        ksz_x = tuple(int(w.aval.shape[d]) for d in rhs_spec[2:])
        x_sp = [int(x.aval.shape[d]) for d in lhs_spec[2:]]
        plane_px = math.prod(x_sp[i] + pads[i][0] + pads[i][1] - ksz_x[i] + 1 for i in range(1, nsp))
        # adjacent output columns side by side along the lanes (see `lane_pack`); a pool over W takes its
        # window as the packing (the window is then a max/sum across a row's lane groups), or none
        choices = ((1, pw) if pw > 1 else (1,)) if ep.pool_windows else LANE_PACKS
        pack, n_merged = lane_pack(
            c_in_x,
            int(w.aval.shape[rhs_spec[0]]),
            ksz_x,
            depthwise,
            plane_bytes=plane_px * x.aval.dtype.itemsize if per_plane else 0,
            choices=choices,
        )
        packed = pack > 1
        if packed:  # the epilogue again, on rows of `pack` columns (channel reductions by lane group)
            try:
                ep = build_epilogue(self, e, [f"e{k}_ref" for k in range(n_extra)], pack=pack)
            except EmitError as exc:
                raise LowerError(str(exc)) from exc
        # names the kernel body uses for the last spatial dim's tap count and window width: with packing,
        # taps and columns come in groups of `pack` columns (the packed input's W axis)
        k_of = {a: f"n_k{a}_g" if packed and a == last else f"n_k{a}" for a in sp}
        ow = f"n_o{last}_g" if packed else f"n_o{last}_p"
        first = "pl.ds(plane + k{a}, 1)" if per_plane else "pl.ds(k{a}, rows)"
        win = ", ".join(
            ["0", first.format(a=lead)]
            + [f"pl.ds(k{a}, {ow})" if a == last else f"pl.ds(k{a}, n_o{a})" for a in sp[1:]]
            + [":"]
        )
        flat = " * ".join(["1" if per_plane else "rows"] + [f"n_o{a}" for a in sp[1:-1]] + [ow])
        tap_idx = ", ".join(f"k{a}" for a in sp)
        merged = n_merged > 0
        inner = sp[nsp - n_merged :] if merged else sp[-1:]
        outer = sp[: nsp - len(inner)]
        # a depthwise conv of a narrower dtype converts its halo'd block to f32 once per step into VMEM
        # scratch, not each tap's window again (49 converts per input element for a 7x7 filter; the VPU
        # then does a multiply and an add per tap)
        staged = depthwise and not per_plane and x.aval.dtype.itemsize < 4
        if staged:
            sub = 8  # the windows are f32 slices of the staged block: 8-row sublane tiles, not bf16's 16
        lines = (
            [
                "xs_ref[...] = x_ref[0].astype(jnp.float32)  # f32[rows + n_kh - 1, W padded, bo]: converted once"
            ]
            if staged
            else []
        )
        for k, a in enumerate(outer):
            lines.append(f"{'    ' * k}def taps_{a}(k{a}, acc):")
        depth_in = len(outer)
        outer_idx = ", ".join(f"k{a}" for a in outer) or "..."
        if merged:
            taps_of = " ".join(f"for k{a} in range({k_of[a]})" for a in inner)
            what = "".join(a.upper() for a in inner)
            lines.append(
                f"{'    ' * depth_in}window = jnp.concatenate([x_ref[{win}] {taps_of}], axis=-1)  # the {what} "
                f"taps' shifted windows side by side: one (taps * C_in)-deep contraction"
            )
            dot = (
                f"jnp.dot(window.reshape({flat}, window.shape[-1]), w_ref[{outer_idx}], "
                f"preferred_element_type=jnp.float32{prec_code})"
            )
            lines.append(
                f"{'    ' * depth_in}{'acc += ' if outer else 'acc = '}{dot}"
                + ("" if outer else f"  # f32[{flat}, bo]")
            )
        else:
            lines.append(f"{'    ' * depth_in}for k{last} in range({k_of[last]}):")
            src_win = f"xs_ref[{win.removeprefix('0, ')}]" if staged else f"x_ref[{win}]"
            lines.append(
                f"{'    ' * (depth_in + 1)}window = {src_win}  # the tap's shifted window of the halo'd block"
            )
            if depthwise:  # one filter per channel: a VPU multiply-add per tap, no contraction for the MXU
                lines.append(
                    f"{'    ' * (depth_in + 1)}acc += window.reshape({flat}, window.shape[-1])"
                    f"{'' if staged else '.astype(jnp.float32)'} * w_ref[{tap_idx}].astype(jnp.float32)  "
                    "# (pixels, bo) * (1, bo)"
                )
            else:
                lines.append(
                    f"{'    ' * (depth_in + 1)}acc += jnp.dot(window.reshape({flat}, window.shape[-1]), "
                    f"w_ref[{tap_idx}], preferred_element_type=jnp.float32{prec_code})"
                )
        if outer:
            lines.append(f"{'    ' * depth_in}return acc")
            for k in range(len(outer) - 1, 0, -1):
                lines.append("")
                lines.append(f"{'    ' * k}return lax.fori_loop(0, n_k{outer[k]}, taps_{outer[k]}, acc)")
            lines.append("")
            lines.append(
                f"acc = lax.fori_loop(0, n_k{outer[0]}, taps_{outer[0]}, "
                f"jnp.zeros(({flat}, w_ref.shape[-1]), jnp.float32))  # f32[{flat}, bo]"
            )
        if ep.lines:
            lines.append("# fused epilogue on the f32 accumulator: no HBM round trip of the conv result")
            lines.extend(ep.lines)
        init: list[str] = []
        if reduced:
            first_step = (
                "(pl.program_id(1) == 0) & (pl.program_id(2) == 0)"
                if batch_reduced
                else ("pl.program_id(2) == 0")
            )
            init = [
                f"@pl.when({first_step})  # the {'(C_out,)' if batch_reduced else '(N, C_out)'} results stay "
                f"resident over {'batch and ' if batch_reduced else ''}row steps",
                "def _init():",
            ]
        for o, v, r in zip(out_refs, outs, ep.results, strict=True):
            if r is None:  # a spatial reduction: accumulated across row steps
                src, prim = ep.reductions[v]
                ident = SPATIAL_REDUCTIONS[prim]
                combine = "jnp.maximum" if prim == "reduce_max" else "jnp.add"
                fold = "jnp.max" if prim == "reduce_max" else "jnp.sum"
                first_row = "pl.program_id(2) * rows" + (" + plane" if per_plane else "")
                row_ext = "1" if per_plane else "rows"
                mid = "".join(f"n_o{a}, " for a in sp[1:-1])
                init.append(f"    {o}[...] = jnp.full({o}.shape, {ident}, {o}.dtype)")
                lines.append(f"blk = {src}.reshape({row_ext}, {mid}{ow}, {src}.shape[-1])")
                col_ok = (
                    # lane l of column group g holds column g * pack + l // C_out: valid while that is below
                    # n_valid, i.e. while l < (n_valid - g * pack) * C_out (no integer division on vectors)
                    f"lax.broadcasted_iota(jnp.int32, part.shape, 1) < (n_valid_{last} - pack * "
                    f"lax.broadcasted_iota(jnp.int32, part.shape, 0)) * (part.shape[-1] // pack)"
                    if packed
                    else f"lax.broadcasted_iota(jnp.int32, part.shape, 0) < n_valid_{last}"
                )
                # padded rows/columns (the conv of zero padding, not zero after the epilogue) do not count.
                # Rows: masked only when the last row block has padded ones (rows and n_valid are static);
                # columns: after the fold over the rows, on one (W, C) slab instead of the whole block
                lines += [
                    f"if n_valid_{lead} % rows:  # padded {'planes' if per_plane else 'rows'} in the last row block",
                    f"    blk = jnp.where({first_row} + lax.broadcasted_iota(jnp.int32, blk.shape, 0) < "
                    f"n_valid_{lead}, blk, {ident})",
                    f"part = {fold}(blk, axis=tuple(range(blk.ndim - 2)))  # ({'column groups' if packed else 'W'}, C)",
                    f"part = jnp.where({col_ok}, part, {ident})",
                    f"{o}[...] = {combine}({o}[...], {fold}(part, axis=0, keepdims=True))",
                ]
            elif per_plane:
                at = f"lax.div(plane, {pool_windows[0]})" if is_pooled[outs.index(v)] else "plane"
                lines.append(f"{o}[pl.ds({at}, 1)] = {r}.reshape(1, *{o}.shape[1:]).astype({o}.dtype)")
            else:
                lines.append(f"{o}[...] = {r}.reshape({o}.shape).astype({o}.dtype)")
        if init:
            init.append("")
        accumulate = "".join(f"{pad}{line}\n" if line else "\n" for line in lines)
        carry0 = (
            f"jnp.zeros((n_o{sp[1]} // {ph}, {ow if packed else f'n_o{last}_p // {pw}'}, "
            f"w_ref.shape[-1]{' // pack' if packed else ''}), "
            "jnp.float32)"
            if ep.pool_windows and per_plane and pool_windows[0] > 1
            else "0"
        )  # the depth window of a 3-D pool so far
        if per_plane:
            body = (
                ("".join(f"    {line}\n" if line else "\n" for line in init) if init else "")
                + "    def one_plane(plane, carry):\n"
                + accumulate
                + "        return carry\n\n"
                f"    lax.fori_loop(0, rows, one_plane, {carry0})"
            )
        else:
            body = ("".join(f"    {line}\n" if line else "\n" for line in init) + accumulate).rstrip("\n")
        ep_refs = [f"e{k}_ref" for k in range(len(ep.inputs))]
        ep_names = [self.low.name_of(v) for v in ep.inputs]
        ep_args = [f"ep{k}" for k in range(len(ep.inputs))]
        ep_maps = ""
        if "chan" in ep.input_roles:
            ep_maps += (
                f"\n\ndef {s}_chan_index_map({grid_args}):\n"
                "    return (0, o_index)  # the output-channel block\n"
            )
        if "scalar" in ep.input_roles:
            ep_maps += f"\n\ndef {s}_scalar_index_map({grid_args}):\n    return (0, 0)\n"
        ep_prep = "".join(
            (
                f"    {a} = jnp.concatenate([_pad_to(jnp.reshape({n}, (1, -1)), (1, n_out_p))] * pack, axis=-1)  # "
                "per-channel epilogue operand, once per packed column\n"
                if packed
                else f"    {a} = _pad_to(jnp.reshape({n}, (1, -1)), (1, n_out_p))  # per-channel epilogue operand\n"
            )
            if r == "chan"
            else f"    {a} = jnp.reshape({n}, (1, 1))  # scalar epilogue operand\n"
            for a, n, r in zip(ep_args, ep_names, ep.input_roles, strict=True)
        )
        lanes_code = "pack * bo" if packed else "bo"  # the lane dim of output, weight and channel blocks
        ep_specs = "".join(
            f"\n            pl.BlockSpec((1, {'pack * bo' if packed else 'bo'}), {s}_chan_index_map),"
            if r == "chan"
            else f"\n            pl.BlockSpec((1, 1), {s}_scalar_index_map),"
            for r in ep.input_roles
        )
        out_block = (
            f"pl.BlockSpec((None, rows, {', '.join([f'n_o{a}' for a in sp[1:-1]] + [f'n_o{last}_p // pack' if packed else f'n_o{last}_p'])}, "
            f"{'pack * bo' if packed else 'bo'}), "
            f"{s}_out_index_map)"
        )
        pooled_mid = "".join(f"n_o{a} // {q}, " for a, q in zip(sp[1:-1], pool_windows[1:-1], strict=True))
        pooled_dims = (
            f"    pooled_dims = (n_b, n_o{lead}_p // {pool_windows[0]}, {pooled_mid}n_o{sp[-1]}_p // {pw}, n_out_p)  "
            "# the pooled output\n"
            if any(is_pooled)
            else ""
        )
        pooled_block = (
            f"pl.BlockSpec((None, rows // {pool_windows[0]}, {pooled_mid}n_o{sp[-1]}_p // {pw}, bo), "
            f"{s}_out_index_map)"
        )
        red_block = f"pl.BlockSpec((None, 1, {'pack * bo' if packed else 'bo'}), {s}_reduced_index_map)"
        if reduced:
            ep_maps += (
                f"\n\ndef {s}_reduced_index_map({grid_args}):\n"
                f"    return ({'0' if batch_reduced else 'n_index'}, 0, o_index)  # the same block for every "
                f"{'batch and ' if batch_reduced else ''}row step: an accumulator\n"
            )
        red_kw = (f", n_valid_{lead}, n_valid_{sp[-1]}" if reduced else "") + (", pack" if packed else "")
        red_args = (f", n_valid_{lead}=n_o{lead}, n_valid_{sp[-1]}=n_o{sp[-1]}" if reduced else "") + (
            ", pack=pack" if packed else ""
        )
        out_shapes = ", ".join(
            f"jax.ShapeDtypeStruct(({'1' if batch_reduced else 'n_b'}, 1, {'pack * n_out_p' if packed else 'n_out_p'}), "
            "jnp.float32)"
            if r is None
            else f"jax.ShapeDtypeStruct({'pooled_dims' if pooled else 'out_dims'}, {dtype_code(dtype_name(v.aval))})"
            for v, r, pooled in zip(outs, ep.results, is_pooled, strict=True)
        )
        out_blocks = ", ".join(
            red_block if r is None else pooled_block if pooled else out_block
            for r, pooled in zip(ep.results, is_pooled, strict=True)
        )
        out_sizes = ", ".join(f"n_o{a}" for a in sp)

        def unpacked(k: int) -> str:
            """The k-th output with its packed columns back in their own rows (a free reshape in HBM)."""
            return f"out[{k}].reshape(*out[{k}].shape[:-2], n_o{last}_p, n_out_p)" if packed else f"out[{k}]"

        def packed_fold(k: int, v: Any) -> str:
            """Code folding the `pack` lane groups of a packed spatial reduction (one per column of a group)."""
            combine = "jnp.maximum" if ep.reductions[v][1] == "reduce_max" else "jnp.add"
            at = "0, 0" if batch_reduced else ":, 0"
            return (
                f"    out[{k}] = functools.reduce({combine}, [out[{k}][{at}, q * n_out_p : q * n_out_p + n_out] "
                f"for q in range(pack)])  # {'(C_out,)' if batch_reduced else '(N, C_out)'}: the packed "
                "columns' partial results combined"
            )

        crops = "\n".join(
            packed_fold(k, outs[k])
            if r is None and packed
            else (
                f"    out[{k}] = out[{k}][0, 0, :n_out]  # (C_out,), summed over the batch and spatial dims"
                if batch_reduced
                else f"    out[{k}] = out[{k}][:, 0, :n_out]  # (N, C_out), summed over the spatial dims"
            )
            if r is None
            else f"    out[{k}] = _crop(out[{k}], (n_b, {', '.join(f'n_o{a} // {q}' for a, q in zip(sp, pool_windows, strict=True))}, n_out))  # pooled"
            if is_pooled[k]
            else f"    out[{k}] = {transpose_code(f'_crop({unpacked(k)}, (n_b, {out_sizes}, n_out))', view_perm(from_cl, ep.out_perms[k]))}"
            for k, r in enumerate(ep.results)
        )
        semantics = (
            '("parallel", "arbitrary", "arbitrary")'
            if batch_reduced
            else '("parallel", "parallel", "arbitrary")'
            if reduced
            else '("parallel", "parallel", "parallel")'
        )
        ep_doc = ", then the fused epilogue before the one store" if ep.lines else ""
        w_merge = (
            f"\n    wt = wt.reshape({''.join(f'wt.shape[{i}], ' for i in range(nsp - n_merged))}{' * '.join(k_of[a] for a in inner)} * "
            f"{'pack * n_c, pack * n_out_p' if packed else 'n_c, n_out_p'})  # the {''.join(a.upper() for a in inner)} taps' rows stacked: matches their windows side "
            "by side"
            if merged
            else ""
        )
        # a spatial reduction accumulates over row steps: the row axis goes last ("arbitrary" dims must follow
        # the parallel ones), the batch and channel-block axes stay parallel for megacore
        grid_code = (
            f"(n_out_p // bo, n_b, n_o{lead}_p // rows)"
            if batch_reduced
            else f"(n_b, n_out_p // bo, n_o{lead}_p // rows)"
            if reduced
            else f"(n_b, n_o{lead}_p // rows, n_out_p // bo)"
        )
        scratch = (
            f"\n        scratch_shapes=[pltpu.VMEM((rows + n_k{lead} - 1, n_o{last}_p + n_k{last} - 1, bo), "
            "jnp.float32)],  # the halo'd block in f32"
            if staged
            else ""
        )
        x_chan = "o_index * bo" if depthwise else "0"  # depthwise: channel block c of x feeds output block c
        pack_prep = (
            f"    pack = {pack}  # adjacent output columns side by side along the lanes (one matmul row each)\n"
            f"    n_k{last}_g = -(-(pack + n_k{last} - 1) // pack)  # {last.upper()} taps, in groups of `pack` input "
            "columns\n"
            if packed
            else ""
        )
        x_pack = (
            "\n    x = x.reshape(*x.shape[:-2], x.shape[-2] // pack, pack * n_c)  # `pack` columns side by side: "
            "a free reshape"
            if packed
            else ""
        )
        w_pack = f"\n    wt = {s}_lane_packed_weights(wt, pack, n_k{last}_g)" if packed else ""
        pack_fn = (
            f"""

def {s}_lane_packed_weights(wt, pack, n_groups):
    \"\"\"(..., K{last}, C_in, C_out) -> (..., n_groups, pack * C_in, pack * C_out): the weights of `pack`
    adjacent output columns side by side. Input column j * pack + q of a window group feeds output column p
    of the packed row through tap j * pack + q - p (zero where that is no tap).\"\"\"
    n_taps = wt.shape[-3]
    zero = jnp.zeros_like(wt[..., :1, :, :])
    cols = [  # concatenations only (jnp.stack is a primitive of its own, not layout, to the Pallas check)
        jnp.concatenate(
            [wt[..., t - p : t - p + 1, :, :] if 0 <= t - p < n_taps else zero for t in range(n_groups * pack)],
            axis=-3,
        )
        for p in range(pack)
    ]
    packed = jnp.concatenate(cols, axis=-1)  # (..., n_groups * pack, C_in, pack * C_out)
    return packed.reshape(*wt.shape[:-3], n_groups, pack * wt.shape[-2], pack * wt.shape[-1])
"""
            if packed
            else ""
        )
        x_kw = ", bo" if depthwise else ""
        x_last = (
            "*(pl.Element(d) for d in x.shape[2:-1]), pl.Element(bo)"
            if depthwise
            else ("*(pl.Element(d) for d in x.shape[2:])")
        )
        code = f'''def {s}_x_index_map({grid_args}, *, rows{x_kw}):
    return (n_index, r_index * rows, {", ".join(["0"] * (nsp - 1) + [x_chan])})  # element offsets


def {s}_w_index_map({grid_args}):
    return ({", ".join(["0"] * (nsp + 1 - n_merged))}, o_index)


def {s}_out_index_map({grid_args}):
    return (n_index, r_index, {", ".join(["0"] * (nsp - 1))}, o_index)
{ep_maps}{pack_fn}

def {s}_kernel(x_ref, w_ref, {", ".join(ep_refs + out_refs + (["xs_ref"] if staged else []))}, *, rows, {
            ", ".join(k_of[a] for a in sp)
        }, {", ".join(f"n_o{a}" for a in sp[1:-1]) + ", " if nsp > 2 else ""}{ow}{red_kw}):
    """Sum over kernel taps of (shifted input window) x (tap weights), all from VMEM{ep_doc}."""
{body}


def {s}({", ".join([xn, wn, *ep_names])}):
    """Direct convolution: halo'd row blocks in VMEM, one MXU matmul per kernel tap into an f32 accumulator."""
    x = {transpose_code(xn, to_cl)}  # channels last: (N, {", ".join(sp.upper())}, C)
    wt = {transpose_code(wn, w_perm)}  # ({", ".join("K" + a for a in sp)}, C_in, C_out)
    n_b = x.shape[0]
    n_c, n_out = wt.shape[-2], wt.shape[-1]
{chr(10).join(f"    n_k{a} = wt.shape[{i}]" for i, a in enumerate(sp))}
{
            chr(10).join(
                f"    n_o{a} = x.shape[{i + 1}] + {pads[i][0]} + {pads[i][1]} - n_k{a} + 1"
                for i, a in enumerate(sp)
            )
        }
{pack_prep}    rows = _block(n_o{lead}, {
            f"_round_up({c}BLOCK_ROWS, {pool_windows[0]})" if pool_windows[0] > 1 else f"{c}BLOCK_ROWS"
        }, {pool_windows[0]})
    {
            "bo = n_out  # every channel in one block (the whole dim): the epilogue reduces over them"
            if ep.channel_reduced
            else "bo = n_out  # every channel in one block: a packed row holds `pack` columns' channels"
            if packed
            else f"bo = _block(n_out, {c}BLOCK_O, 128)"
        }
    n_o{lead}_p = _round_up(n_o{lead}, rows)
    n_o{sp[-1]}_p = _round_up(n_o{sp[-1]}, {math.lcm(sub, pw)}{" * pack" if packed else ""})
    n_out_p = _round_up(n_out, bo)
    # zero padding: the convolution's own, plus rows/columns up to whole blocks (cropped afterwards)
    x = jnp.pad(x, [(0, 0), {
            ", ".join(
                f"({pads[i][0]}, {pads[i][1]} + n_o{a}_p - n_o{a} + n_k{a}_g * pack - pack - n_k{a} + 1)"
                if packed and a == last
                else f"({pads[i][0]}, {pads[i][1]} + n_o{a}_p - n_o{a})"
                if a in (lead, sp[-1])
                else f"({pads[i][0]}, {pads[i][1]})"
                for i, a in enumerate(sp)
            )
        }, {"(0, n_out_p - n_out)" if depthwise else "(0, 0)"}]){x_pack}
    wt = _pad_to(wt, (*wt.shape[:-1], n_out_p)){w_pack}{w_merge}
{ep_prep}    out_dims = (n_b, {
            ", ".join(
                (f"n_o{a}_p // pack" if packed and a == last else f"n_o{a}_p")
                if a in (lead, sp[-1])
                else f"n_o{a}"
                for a in sp
            )
        }, {"pack * n_out_p" if packed else "n_out_p"})
{pooled_dims}    out_shape = [{out_shapes}]  # ({
            ", ".join(f"n_o{a}_p" if a in (lead, sp[-1]) else f"n_o{a}" for a in sp)
        }, C_out padded)
    cost = pl.CostEstimate(
        flops=2 * n_b * {" * ".join(f"n_o{a}" for a in sp)} * {
            " * ".join(f"n_k{a}" for a in sp)
        } * n_c * n_out,
        transcendentals=0,
        bytes_accessed=_nbytes(x, wt, {"".join(f"{n}, " for n in ep_args)}*out_shape),
    )
    out = list(pl.pallas_call(
        functools.partial(
            {s}_kernel, rows=rows, {", ".join(f"{k_of[a]}={k_of[a]}" for a in sp)}, {
            ", ".join(f"n_o{a}=n_o{a}" for a in sp[1:-1]) + ", " if nsp > 2 else ""
        }{ow}={f"n_o{last}_p // pack" if packed else ow}{red_args}
        ),
        grid={grid_code},
        in_specs=[
            pl.BlockSpec(  # element offsets (every dim, as Pallas requires): blocks overlap by the halo
                (pl.Element(1), pl.Element(rows + n_k{lead} - 1), {x_last}),
                functools.partial({s}_x_index_map, rows=rows{", bo=bo" if depthwise else ""}),
            ),
            pl.BlockSpec((*wt.shape[:-1], {lanes_code}), {s}_w_index_map),{ep_specs}
        ],
        out_specs=[{out_blocks}],
        out_shape=out_shape,{scratch}
        compiler_params=pltpu.CompilerParams(
            dimension_semantics={semantics},
            vmem_limit_bytes={c}VMEM_LIMIT_BYTES,
        ),
        cost_estimate=cost,
    )(x, wt{"".join(f", {n}" for n in ep_args)}))
{crops}
    return {", ".join(f"out[{k}]" for k in range(len(outs)))}
'''
        xs = tuple(int(v) for v in x.aval.shape)
        ws = tuple(int(v) for v in w.aval.shape)
        n_b = xs[lhs_spec[0]]
        c_in = xs[lhs_spec[1]]
        in_sp = [xs[d] for d in lhs_spec[2:]]
        ksz = [ws[d] for d in rhs_spec[2:]]
        c_out = ws[rhs_spec[0]]
        out_sp = [in_sp[i] + pads[i][0] + pads[i][1] - ksz[i] + 1 for i in range(nsp)]
        w_last = -(-out_sp[-1] // (sub * pack)) * sub  # block columns (column groups when packed)
        taps = math.prod(ksz)
        # what the MXU sees: with packing, groups of `pack` columns (taps and channels side by side)
        kq = list(packed_taps(tuple(ksz), pack)) if packed else ksz
        cq = pack * c_in
        params = [
            ParamSpec(
                name=f"{c}BLOCK_ROWS",
                role="leading",
                align=pool_windows[0],  # whole pooling windows per row block
                extent=out_sp[0],
                default=0,
                doc=f"output rows along {sp[0].upper()} per grid step",
            ),
            ParamSpec(
                name=f"{c}BLOCK_O",
                role="lane",
                # a reduction over the channels needs them all in one block: the only block is the whole dim
                align=c_out if ep.channel_reduced or packed else 128,
                extent=c_out,
                default=c_out if ep.channel_reduced or packed else 0,
                doc="output channels per step"
                + (" (all of them: the epilogue reduces over the channels)" if ep.channel_reduced else "")
                + (f" (all of them: {pack} columns' channels share a matmul row)" if packed else ""),
            ),
        ]
        pr, po = (DimRef(kind="param", param=q.name, extent=q.extent) for q in params)
        if packed:  # a block row holds every channel of `pack` columns
            po = DimRef(kind="full", extent=pack * c_out)
        padded_sp = [in_sp[i] + pads[i][0] + pads[i][1] for i in range(nsp)]
        mid = [DimRef(kind="full", extent=v) for v in out_sp[1:-1]]
        buffers = [
            BufferSpec(
                what="halo'd input rows",
                dims=[pr]
                + [DimRef(kind="full", extent=v) for v in padded_sp[1:-1]]
                + [DimRef(kind="full", extent=-(-padded_sp[-1] // pack))]
                + [po if depthwise else DimRef(kind="full", extent=cq)],
                itemsize=x.aval.dtype.itemsize,
                kind="input",
                axes=[ax_n, ax_r],
                hbm_bytes=nbytes(x),
            ),
            BufferSpec(
                what="weights block",
                dims=[DimRef(kind="full", extent=taps if depthwise else math.prod(kq) * cq), po],
                itemsize=w.aval.dtype.itemsize,
                kind="input",
                axes=[ax_o],
                hbm_bytes=nbytes(w),
            ),
            *(
                BufferSpec(
                    what="per-channel epilogue operand" if r == "chan" else "scalar epilogue operand",
                    dims=[
                        DimRef(kind="full", extent=1),
                        po if r == "chan" else DimRef(kind="full", extent=1),
                    ],
                    itemsize=v.aval.dtype.itemsize,
                    kind="input",
                    axes=[ax_o] if r == "chan" else [],
                    hbm_bytes=nbytes(v),
                )
                for v, r in zip(ep.inputs, ep.input_roles, strict=True)
            ),
            *(
                BufferSpec(
                    what="output block",
                    dims=[pr, *mid, DimRef(kind="full", extent=w_last), po],
                    itemsize=out.aval.dtype.itemsize,
                    kind="output",
                    axes=[0, 1, 2],
                    hbm_bytes=nbytes(out),
                )
                if r is not None
                else BufferSpec(  # written back once per (batch, channel block), after the last row step
                    what="spatially reduced (N, C_out) block",
                    dims=[DimRef(kind="full", extent=1), po],
                    itemsize=4,
                    kind="output",
                    axes=[ax_o] if batch_reduced else [ax_n, ax_o],
                    hbm_bytes=nbytes(out),
                )
                for out, r in zip(outs, ep.results, strict=True)
            ),
            *(
                [
                    BufferSpec(
                        what=f"the {', '.join(a.upper() for a in inner)} taps' windows side by side (im2col of "
                        f"{'one output plane' if per_plane else 'the row block'}, in VMEM)",
                        dims=[
                            DimRef(kind="full", extent=1) if per_plane else pr,
                            *mid,
                            DimRef(kind="full", extent=w_last),
                            DimRef(kind="full", extent=math.prod(kq[nsp - n_merged :]) * cq),
                        ],
                        itemsize=x.aval.dtype.itemsize,
                        copies=1,
                        kind="temporary",
                    )
                ]
                if merged
                else []
            ),
            *(
                [
                    BufferSpec(
                        what="the halo'd input block converted to f32 once per step",
                        dims=[pr, DimRef(kind="full", extent=padded_sp[-1]), po],
                        itemsize=4,
                        copies=1,
                        kind="scratch",
                    )
                ]
                if staged
                else []
            ),
            BufferSpec(
                what="f32 accumulator",
                dims=[pr, *mid, DimRef(kind="full", extent=w_last), po],
                itemsize=4,
                copies=2,
                kind="temporary",
            ),
        ]
        flops = 2.0 * n_b * math.prod(out_sp) * taps * (1 if depthwise else c_in) * c_out
        spec = KernelSpec(
            name=s,
            family=self.family,
            title=(
                f"{nsp}-D depthwise convolution as {taps} shifted VPU multiply-adds over halo'd row blocks in VMEM"
                if depthwise
                else (
                    f"{nsp}-D convolution as {math.prod(kq) // math.prod(kq[nsp - n_merged :])} matmul(s) of "
                    f"{math.prod(kq[nsp - n_merged :])} shifted windows side by side "
                    f"({math.prod(kq[nsp - n_merged :])} x {cq} deep) over halo'd row blocks in VMEM (no im2col "
                    "in HBM)" + (f", {pack} output columns per matmul row" if packed else "")
                )
                if merged
                else f"{nsp}-D convolution as {taps} shifted matmuls over halo'd row blocks in VMEM (no im2col)"
            ),
            code=code,
            params=params,
            grid=[
                axis
                for _, axis in sorted(
                    [
                        (
                            ax_n,
                            GridAxis(
                                name="n_index",
                                extent=n_b,
                                param=None,
                                semantics="arbitrary" if batch_reduced else "parallel",
                            ),
                        ),
                        (
                            ax_r,
                            GridAxis(
                                name="r_index",
                                extent=out_sp[0],
                                param=params[0].name,
                                semantics="arbitrary" if reduced else "parallel",
                            ),
                        ),
                        (ax_o, GridAxis(name="o_index", extent=c_out, param=params[1].name)),
                    ],
                    key=lambda t: t[0],
                )
            ],
            buffers=buffers,
            flops=flops,
            structure=(
                (
                    f"grid ({'output-channel blocks, batch' if batch_reduced else 'batch, output-channel blocks'}, "
                    f"output-row blocks), the {'batch and row axes' if batch_reduced else 'row axis'} arbitrary: "
                    "each step fetches the halo'd rows its output rows read, sums one MXU matmul per kernel tap "
                    "into an f32 accumulator, runs the epilogue on it and adds the masked block into the resident "
                    f"{'(C_out,)' if batch_reduced else '(N, C_out)'} spatial reductions"
                    + (
                        "; the full-size result is never written"
                        if all(r is None for r in ep.results)
                        else ", and writes its block of the full-size result once (the statistics of a norm "
                        "come out of the same pass)"
                    )
                )
                if reduced
                else (
                    "grid (batch, output-row blocks, output-channel blocks), all parallel; each step fetches the "
                    "halo'd rows its output rows read (element-offset block), sums one MXU matmul per kernel "
                    "tap of the tap's shifted window into an f32 accumulator"
                    + (", runs the fused epilogue on it" if ep.lines else "")
                    + " and writes its rows once"
                )
            ),
            notes=[
                "no im2col array in HBM: the taps read shifted windows of a halo'd block in VMEM",
                "the block model sizes the input block as `rows` rows; the k-1 halo rows are not counted",
                *(
                    [
                        f"C_in={cq} does not fill a {MXU_DEPTH}-deep MXU: the "
                        f"{math.prod(kq[nsp - n_merged :])} taps along {', '.join(a.upper() for a in inner)} are "
                        "concatenated along the channels in VMEM and contracted at once (depth padded "
                        f"{' / '.join(str(padded_depth(cq, tuple(kq), n_merged, d)) for d in MXU_DEPTHS)} vs "
                        f"{' / '.join(str(padded_depth(cq, tuple(kq), 0, d)) for d in MXU_DEPTHS)} per tap "
                        f"on {' / '.join(str(d) for d in MXU_DEPTHS)}-deep MXUs)"
                    ]
                    if merged
                    else []
                ),
                *(
                    [
                        f"C_out={c_out} fills {c_out}/{' and '.join(str(d) for d in MXU_DEPTHS)} of the MXU's "
                        f"width: {pack} adjacent output columns per matmul row ({pack * c_out} lanes), the input "
                        f"reshaped to {pack}-column groups in HBM and the weights block-banded to match"
                    ]
                    if packed
                    else []
                ),
            ],
        )
        return spec, f"{s}({', '.join([xn, wn, *ep_names])})"
