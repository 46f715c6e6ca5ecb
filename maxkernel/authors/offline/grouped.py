"""Grouped matmul (`lax.ragged_dot`): rows of lhs fall into consecutive groups whose sizes arrive at run
time; group g multiplies rhs[g]. One kernel, written from a template rather than re-emitted from the jaxpr.

The group sizes go to SMEM by scalar prefetch. The grid walks (column block, visit, K block) with visits
and K sequential; a visit is one (group, row block) pair that holds rows of the group, so the grid has
M/bm + groups - 1 visits at most instead of M/bm x groups steps. Each visit masks the rows of other groups
to zero before the MXU multiply-add into an f32 accumulator; a row block shared by two groups is visited
by both back to back, so its output tile stays in VMEM and is written once. Visits past the last live one
repeat its block indices (no copy) and skip compute (`pl.when`). Rows past the last group stay zero, as
`ragged_dot` defines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from maxkernel.authors.offline.emit import dtype_code, dtype_name
from maxkernel.authors.offline.kernels import SUBLANE, KernelBuilder, LowerError, nbytes, precision_arg
from maxkernel.authors.offline.partition import Region
from maxkernel.authors.offline.spec import BufferSpec, DimRef, GridAxis, KernelSpec, ParamSpec

if TYPE_CHECKING:
    from maxkernel.authors.offline.lower import Lowering


class GroupedMatmulBuilder(KernelBuilder):
    family = "grouped_matmul"

    def __init__(self, low: Lowering, region: Region, index: int, n_kernels: int) -> None:
        super().__init__(low, region, index, n_kernels)
        self.eqn = self.g.eqns[min(region.owned)]
        if len(self.outputs) != 1:
            raise LowerError("a grouped matmul whose raw and cast results are both needed")

    def build(self) -> tuple[KernelSpec, str]:
        e = self.eqn
        p = e.params
        dn = p["ragged_dot_dimension_numbers"]
        (lc, rc), (lb, rb) = dn.dot_dimension_numbers
        lhs, rhs, sizes = e.invars
        if (
            tuple(lc) == (0,)
            and tuple(rc) == (0,)
            and not lb
            and not rb
            and tuple(dn.lhs_ragged_dimensions) == (0,)
            and tuple(dn.rhs_group_dimensions) == ()
            and len(lhs.aval.shape) == 2
            and len(rhs.aval.shape) == 2
            and p.get("group_offset") is None
        ):
            return self._build_ragged_contraction()
        if (
            tuple(lc) != (1,)
            or tuple(rc) != (1,)
            or lb
            or rb
            or tuple(dn.lhs_ragged_dimensions) != (0,)
            or tuple(dn.rhs_group_dimensions) != (0,)
            or len(lhs.aval.shape) != 2
            or len(rhs.aval.shape) != 3
        ):
            raise LowerError("a ragged_dot with dimension numbers other than (m, k) x (g, k, n)")
        if p.get("group_offset") is not None:
            raise LowerError("a ragged_dot with a group offset")
        out = self.outputs[0]
        odt = dtype_name(out.aval)
        m, k = (int(s) for s in lhs.aval.shape)
        g, _, n = (int(s) for s in rhs.aval.shape)
        s = self.stem
        c = self.cprefix
        names = [self.low.name_of(v) for v in (lhs, rhs, sizes)]
        ln, rn, sn = names
        lsub = SUBLANE.get(lhs.aval.dtype.itemsize, 8)
        prec = precision_arg(e)
        code = f'''def {s}_visit(t_index, sizes_ref, *, bm, n_groups, n_m):
    """(group, row block, first row, end row, live, first visit of the block, last visit of the block) of
    visit `t_index`, in one pass over the group sizes (scalar work, once per grid step and index map).

    Visits walk the groups in order and, within a group, the row blocks it has rows in, so a row block
    split between groups is visited once per group back to back (its output tile stays in VMEM between
    them); then one visit per row block past the last group's rows (no rows: zeros). Visits past the last
    live one repeat it (live False): their block indices do not change, so the pipeline copies nothing."""

    def find(j, carry):
        start, before, group, block, row0, row1, last_group, last_block = carry
        size = sizes_ref[j]
        end = start + size
        # rows are non-negative: truncating division is floor division without the sign fix-up
        first = lax.div(start, jnp.int32(bm))
        n_vis = jnp.where(size > 0, lax.div(end - 1, jnp.int32(bm)) - first + 1, 0)
        hit = (t_index >= before) & (t_index < before + n_vis)
        group = jnp.where(hit, j, group)
        block = jnp.where(hit, first + t_index - before, block)
        row0 = jnp.where(hit, start, row0)
        row1 = jnp.where(hit, end, row1)
        last_group = jnp.where(size > 0, j, last_group)
        last_block = jnp.where(size > 0, lax.div(end - 1, jnp.int32(bm)), last_block)
        return end, before + n_vis, group, block, row0, row1, last_group, last_block

    init = (0, 0, n_groups - 1, 0, 0, 0, n_groups - 1, 0)
    total, seen, group, block, row0, row1, last_group, last_block = lax.fori_loop(0, n_groups, find, init)
    covered = lax.div(total + bm - 1, jnp.int32(bm))  # row blocks holding some group's rows
    n_tail = jnp.maximum(n_m - covered, 0)
    live = t_index < seen + n_tail
    tail = t_index >= seen  # a row block no group has rows in (or a dead visit): no rows to multiply
    group = jnp.where(live, jnp.where(tail, n_groups - 1, group), jnp.where(n_tail > 0, n_groups - 1, last_group))
    block = jnp.where(live, jnp.where(tail, covered + t_index - seen, block), jnp.where(n_tail > 0, n_m - 1, last_block))
    row0 = jnp.where(tail, 0, row0)
    row1 = jnp.where(tail, 0, row1)
    first_visit = tail | (row0 <= block * bm)  # no earlier group has rows in the block
    last_visit = tail | (row1 >= (block + 1) * bm) | (row1 >= total)  # no later group has rows in it
    return group, jnp.clip(block, 0, n_m - 1), row0, row1, live, first_visit, last_visit


def {s}_kernel(sizes_ref, lhs_ref, rhs_ref, out_ref, acc_ref, *, bm, n_groups, n_m, n_k):
    """Rows of lhs belong to consecutive groups (sizes in SMEM); group g multiplies rhs[g]."""
    t_index = pl.program_id(1)
    k_index = pl.program_id(2)
    _, block, row0, row1, live, first_visit, last_visit = {s}_visit(
        t_index, sizes_ref, bm=bm, n_groups=n_groups, n_m=n_m
    )

    @pl.when(live & first_visit & (k_index == 0))
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    # The MXU work goes in row chunks, each under its own guard: a visit of a row block the group only
    # partly covers multiplies only the chunks holding its rows.
    row_chunk = 256  # a multiple of every sublane tile
    chunk = bm if bm % row_chunk else row_chunk
    for c in range(bm // chunk):
        lo = block * bm + c * chunk  # first row of the chunk

        @pl.when(live & (row0 < lo + chunk) & (row1 > lo))
        def _accumulate(c=c, lo=lo):
            rows = lo + lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
            part = pl.ds(c * chunk, chunk)
            lhs_blk = jnp.where((rows >= row0) & (rows < row1), lhs_ref[part, :], 0)  # other groups' rows -> 0
            acc_ref[part, :] += jnp.dot(lhs_blk, rhs_ref[...], preferred_element_type=jnp.float32{prec})

    @pl.when(live & last_visit & (k_index == n_k - 1))
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def {s}({ln}, {rn}, {sn}):
    """lax.ragged_dot({ln}, {rn}, {sn}) as one Pallas kernel; pads M, N, K to the blocks and crops."""
    n_m, n_k = {ln}.shape
    n_groups, _, n_n = {rn}.shape
    bm = _block(n_m, {c}BLOCK_M, {lsub})
    bn = _block(n_n, {c}BLOCK_N, 128)
    bk = _block(n_k, {c}BLOCK_K, 128)
    n_m_p, n_n_p, n_k_p = _round_up(n_m, bm), _round_up(n_n, bn), _round_up(n_k, bk)
    {ln} = _pad_to({ln}, (n_m_p, n_k_p))
    {rn} = _pad_to({rn}, (n_groups, n_k_p, n_n_p))
    # at most one visit per row block plus one per group boundary inside a block
    n_visits = n_m_p // bm + n_groups - 1
    visit = functools.partial({s}_visit, bm=bm, n_groups=n_groups, n_m=n_m_p // bm)

    def lhs_index_map(n_index, t_index, k_index, sizes_ref):
        _, block, _, _, live, _, _ = visit(t_index, sizes_ref)
        return (block, jnp.where(live, k_index, n_k_p // bk - 1))

    def rhs_index_map(n_index, t_index, k_index, sizes_ref):
        group, _, _, _, live, _, _ = visit(t_index, sizes_ref)
        return (group, jnp.where(live, k_index, n_k_p // bk - 1), n_index)

    def out_index_map(n_index, t_index, k_index, sizes_ref):
        _, block, _, _, _, _, _ = visit(t_index, sizes_ref)
        return (block, n_index)

    out_shape = jax.ShapeDtypeStruct((n_m_p, n_n_p), {dtype_code(odt)})
    cost = pl.CostEstimate(
        flops=2 * n_m * n_n * n_k,
        transcendentals=0,
        bytes_accessed=_nbytes({ln}, {rn}, out_shape),
    )
    out = pl.pallas_call(
        functools.partial({s}_kernel, bm=bm, n_groups=n_groups, n_m=n_m_p // bm, n_k=n_k_p // bk),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(n_n_p // bn, n_visits, n_k_p // bk),
            in_specs=[
                pl.BlockSpec((bm, bk), lhs_index_map),
                pl.BlockSpec((None, bk, bn), rhs_index_map),
            ],
            out_specs=pl.BlockSpec((bm, bn), out_index_map),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes={c}VMEM_LIMIT_BYTES,
        ),
        cost_estimate=cost,
    )({sn}.astype(jnp.int32), {ln}, {rn})
    return _crop(out, (n_m, n_n))
'''
        isz_l, isz_r = lhs.aval.dtype.itemsize, rhs.aval.dtype.itemsize
        params = [
            ParamSpec(
                name=f"{c}BLOCK_M",
                role="sublane",
                align=lsub,
                extent=m,
                default=0,
                doc="rows of lhs per grid step (M)",
            ),
            ParamSpec(
                name=f"{c}BLOCK_N",
                role="lane",
                align=128,
                extent=n,
                default=0,
                doc="columns of the output tile (N)",
            ),
            ParamSpec(
                name=f"{c}BLOCK_K",
                role="lane",
                align=128,
                extent=k,
                default=0,
                doc="contraction block (K) per grid step",
            ),
        ]
        pm, pn, pk = (DimRef(kind="param", param=q.name, extent=q.extent) for q in params)
        buffers = [
            BufferSpec(
                what=f"{ln} block",
                dims=[pm, pk],
                itemsize=isz_l,
                kind="input",
                axes=[1, 2],
                hbm_bytes=nbytes(lhs),
            ),
            BufferSpec(
                what=f"{rn} block",
                dims=[pk, pn],
                itemsize=isz_r,
                kind="input",
                axes=[0, 1, 2],
                hbm_bytes=nbytes(rhs),
            ),
            BufferSpec(
                what="output block",
                dims=[pm, pn],
                itemsize=out.aval.dtype.itemsize,
                kind="output",
                axes=[1, 0],
                hbm_bytes=nbytes(out),
            ),
            BufferSpec(what="acc_ref", dims=[pm, pn], itemsize=4, copies=1, kind="scratch"),
        ]
        spec = KernelSpec(
            name=s,
            family=self.family,
            title="grouped matmul (ragged_dot): each row block multiplies the rhs of every group it holds rows of",
            code=code,
            params=params,
            grid=[
                GridAxis(name="n_index", extent=n, param=params[1].name),
                # visits: M/bm row blocks plus at most one per group boundary inside a block (the groups - 1
                # extra visits are left out of the tuner's coarse count)
                GridAxis(name="t_index", extent=m, param=params[0].name, semantics="arbitrary"),
                GridAxis(name="k_index", extent=k, param=params[2].name, semantics="arbitrary"),
            ],
            buffers=buffers,
            flops=2.0 * m * n * k,
            structure=(
                "grid (N/bn, visits, K/bk) with visits and K sequential; group sizes are scalar-prefetched to SMEM "
                "and the visit axis walks only the (group, row block) pairs that hold rows -- M/bm + groups - 1 "
                "visits at most, not M/bm x groups steps; a row block shared by two groups is visited by both back "
                "to back, its output tile and f32 accumulator staying in VMEM, so each output tile is written once; "
                "other groups' rows are masked to zero before the MXU"
            ),
            notes=[
                "visit t finds its (group, row block) from the group sizes; visits past the last live one repeat "
                "its block indices (no copy) and `pl.when` skips their compute; rhs[g] is read once per row block "
                "holding rows of g, every lhs row block about once per N block"
            ],
        )
        return spec, f"{s}({', '.join(names)})"

    def _build_ragged_contraction(self) -> tuple[KernelSpec, str]:
        """`out[g] = lhs[rows of g].T @ rhs[rows of g]` (the transposed grouped matmul of MoE weight
        gradients). Grid (group, K/bk, N/bn, row step): a group visits only the row blocks it overlaps --
        step j of group g reads row block `first(g) + j`, clamped to the group's last block, so the steps past
        it issue no new copy (the block index does not change) and `pl.when` skips their compute. Every row
        block is read about once in total (plus one shared block per group boundary), not once per group."""
        e = self.eqn
        lhs, rhs, sizes = e.invars
        out = self.outputs[0]
        odt = dtype_name(out.aval)
        m, k = (int(s) for s in lhs.aval.shape)
        n = int(rhs.aval.shape[1])
        g = int(sizes.aval.shape[0])
        s = self.stem
        c = self.cprefix
        names = [self.low.name_of(v) for v in (lhs, rhs, sizes)]
        ln, rn, sn = names
        prec = precision_arg(e)
        code = f'''def {s}_group_rows(g_index, sizes_ref, n_groups):
    """First and one-past-last row of group `g_index`: the sizes of the groups before it, summed."""
    start = lax.fori_loop(0, n_groups, lambda j, acc: acc + jnp.where(j < g_index, sizes_ref[j], 0), 0)
    return start, start + sizes_ref[g_index]


def {s}_row_block(g_index, m_index, sizes_ref, *, bm, n_groups):
    """The row block step `m_index` of group `g_index` reads: the group's first block plus the step,
    clamped to its last block (an unchanged block index means no new copy for the steps past the end)."""
    start, end = {s}_group_rows(g_index, sizes_ref, n_groups)
    # rows are non-negative: truncating division is floor division without the sign fix-up `//` lowers to
    first = lax.div(start, jnp.int32(bm))
    last = lax.div(jnp.maximum(end - 1, start), jnp.int32(bm))
    return jnp.minimum(first + m_index, last)


def {s}_kernel(sizes_ref, lhs_ref, rhs_ref, out_ref, acc_ref, *, bm, n_groups):
    """Accumulate lhs_blk.T @ rhs_blk over the row blocks of one group; rows of other groups count as 0."""
    g_index = pl.program_id(0)
    m_index = pl.program_id(3)

    @pl.when(m_index == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    start, end = {s}_group_rows(g_index, sizes_ref, n_groups)
    block = lax.div(start, jnp.int32(bm)) + m_index

    @pl.when((block * bm < end) & (end > start))  # the step still lies inside the group
    def _accumulate():
        rows = block * bm + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
        lhs_blk = jnp.where((rows >= start) & (rows < end), lhs_ref[...], 0)  # [bm, bk], other rows -> 0
        acc_ref[...] += lax.dot_general(
            lhs_blk, rhs_ref[...], (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32{prec}
        )  # [bk, bn]

    @pl.when(m_index == pl.num_programs(3) - 1)
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def {s}({ln}, {rn}, {sn}):
    """lax.ragged_dot_general with a ragged contracting dim as one Pallas kernel; pads rows, K, N, crops."""
    n_m, n_k = {ln}.shape
    n_n = {rn}.shape[1]
    n_groups = {sn}.shape[0]
    bm = _block(n_m, {c}BLOCK_M, 128)
    bk = _block(n_k, {c}BLOCK_K, 128)
    bn = _block(n_n, {c}BLOCK_N, 128)
    n_m_p, n_k_p, n_n_p = _round_up(n_m, bm), _round_up(n_k, bk), _round_up(n_n, bn)
    {ln} = _pad_to({ln}, (n_m_p, n_k_p))
    {rn} = _pad_to({rn}, (n_m_p, n_n_p))
    row_block = functools.partial({s}_row_block, bm=bm, n_groups=n_groups)

    def lhs_index_map(g_index, k_index, n_index, m_index, sizes_ref):
        return (row_block(g_index, m_index, sizes_ref), k_index)

    def rhs_index_map(g_index, k_index, n_index, m_index, sizes_ref):
        return (row_block(g_index, m_index, sizes_ref), n_index)

    def out_index_map(g_index, k_index, n_index, m_index, sizes_ref):
        return (g_index, k_index, n_index)

    out_shape = jax.ShapeDtypeStruct((n_groups, n_k_p, n_n_p), {dtype_code(odt)})
    cost = pl.CostEstimate(
        flops=2 * n_m * n_k * n_n,
        transcendentals=0,
        bytes_accessed=_nbytes({ln}, {rn}, out_shape),
    )
    out = pl.pallas_call(
        functools.partial({s}_kernel, bm=bm, n_groups=n_groups),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(n_groups, n_k_p // bk, n_n_p // bn, n_m_p // bm),
            in_specs=[
                pl.BlockSpec((bm, bk), lhs_index_map),
                pl.BlockSpec((bm, bn), rhs_index_map),
            ],
            out_specs=pl.BlockSpec((None, bk, bn), out_index_map),
            scratch_shapes=[pltpu.VMEM((bk, bn), jnp.float32)],
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes={c}VMEM_LIMIT_BYTES,
        ),
        cost_estimate=cost,
    )({sn}.astype(jnp.int32), {ln}, {rn})
    return _crop(out, (n_groups, n_k, n_n))
'''
        isz_l, isz_r = lhs.aval.dtype.itemsize, rhs.aval.dtype.itemsize
        params = [
            ParamSpec(
                name=f"{c}BLOCK_M",
                role="lane",
                align=128,
                extent=m,
                default=0,
                doc="rows (the contraction) per step",
            ),
            ParamSpec(
                name=f"{c}BLOCK_K",
                role="lane",
                align=128,
                extent=k,
                default=0,
                doc="output rows (lhs columns)",
            ),
            ParamSpec(name=f"{c}BLOCK_N", role="lane", align=128, extent=n, default=0, doc="output columns"),
        ]
        pm, pk, pn = (DimRef(kind="param", param=q.name, extent=q.extent) for q in params)
        buffers = [
            BufferSpec(
                what=f"{ln} block",
                dims=[pm, pk],
                itemsize=isz_l,
                kind="input",
                axes=[3, 1],
                hbm_bytes=nbytes(lhs),
            ),
            BufferSpec(
                what=f"{rn} block",
                dims=[pm, pn],
                itemsize=isz_r,
                kind="input",
                axes=[3, 2],
                hbm_bytes=nbytes(rhs),
            ),
            BufferSpec(
                what="output block",
                dims=[pk, pn],
                itemsize=out.aval.dtype.itemsize,
                kind="output",
                axes=[0, 1, 2],
                hbm_bytes=nbytes(out),
            ),
            BufferSpec(what="acc_ref", dims=[pk, pn], itemsize=4, copies=1, kind="scratch"),
        ]
        spec = KernelSpec(
            name=s,
            family=self.family,
            title="transposed grouped matmul (ragged contraction): each group sums lhs.T @ rhs over its own rows",
            code=code,
            params=params,
            grid=[
                GridAxis(name="g_index", extent=g, param=None),
                GridAxis(name="k_index", extent=k, param=params[1].name),
                GridAxis(name="n_index", extent=n, param=params[2].name),
                GridAxis(name="m_index", extent=m, param=params[0].name, semantics="arbitrary"),
            ],
            buffers=buffers,
            flops=2.0 * m * n * k,
            structure=(
                "grid (groups, K/bk, N/bn, row steps) with the row steps sequential; group sizes are "
                "scalar-prefetched to SMEM; step j of a group reads its (first block + j)-th row block, clamped to "
                "its last one, so steps past the group's rows neither copy nor compute; rows of neighbouring groups "
                "in a shared block are masked to zero before the MXU"
            ),
            notes=[
                "the grid reserves every row block for every group; the steps a group does not need cost only the "
                "per-step overhead (no DMA, no MXU work)"
            ],
        )
        return spec, f"{s}({', '.join(names)})"
