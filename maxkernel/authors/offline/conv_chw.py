"""A 2-D convolution on channels-first (NCHW) data, in the layout PyTorch-style code keeps it: no transpose.

The channels-last kernel (conv_kernel.py) reads `(N, H, W, C)`; PyTorch-layout code (JAXBench's, or any
`jnp.transpose(x, (0, 2, 3, 1))` before an NHWC conv and back after it) then pays two full transposes in
HBM around the kernel, plus XLA's padded copy and the crop: on a conv of 64 -> 128 channels over
128 x 128 images that was most of the time (the kernel itself was a third of it).

Here each sample's image stays as it is, `(C, H * W)` with the pixels on the lanes (a free reshape), and is
fetched whole once per sample. A grid step computes `rows` output rows for every output channel:

* the tap (kh, kw) window of flat pixel p is pixel `p + kh * W + kw` of the step's rows, so each tap is a
  row-aligned lane slice of the block shifted by `kw` lanes (`pltpu.roll`; what wraps round lands in the
  columns past the output width, which are never stored);
* the taps' windows are stacked along the sublanes, `(KH * KW * C, rows * W)`, and one MXU matmul
  `(C_out, KH * KW * C) @ window` gives `(C_out, rows * W)` in f32: channels on the sublanes, pixels on the
  lanes, the NCHW layout itself;
* the epilogue (conv_epilogue.py) runs on that accumulator with per-channel operands as `(C_out, 1)`
  columns, and each output row is stored as the lane slice `[j * W, j * W + W_out)` of it into an NCHW
  block; spatial sums and maxima of the rows are accumulated across the row steps.

The last row block starts at `H_out - rows` instead of running past the image (the rows it shares with the
block before are computed twice, stored once), so no padded copy of the input is made. What it needs:
stride 1, no padding, no dilation or groups, W a multiple of 128 (row starts on lane tiles), C_in a multiple
of 8 at the task's shape (a smaller validation shape whose channels were cut gets zero channels padded on),
and the input available channels-first (the conv's own NCHW input, or the NHWC transpose of one, which
XLA folds with the wrapper's transpose back). Anything else keeps the channels-last kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from maxkernel.authors.offline.conv_epilogue import SPATIAL_REDUCTIONS, Epilogue, view_perm
from maxkernel.authors.offline.emit import dtype_code, dtype_name, transpose_code
from maxkernel.authors.offline.kernels import nbytes
from maxkernel.authors.offline.spec import BufferSpec, DimRef, GridAxis, KernelSpec, ParamSpec

if TYPE_CHECKING:
    from maxkernel.authors.offline.conv_kernel import ConvBuilder

LANE = 128


def _nchw_source(builder: ConvBuilder, x: Any, lhs_spec: tuple[int, ...]) -> bool:
    """Is the conv's input channels-first in HBM: the conv's own NCHW input, or a transpose of an NCHW value
    that the wrapper's transpose back undoes (XLA folds the pair)?"""
    if lhs_spec == (0, 1, 2, 3):
        return True
    g = builder.g
    p = g.producer.get(x)
    if p is None or g.eqns[p].primitive.name != "transpose":
        return False
    perm = tuple(int(a) for a in g.eqns[p].params["permutation"])
    return all(perm[lhs_spec[k]] == k for k in range(4))


def chw_ok(builder: ConvBuilder, e: Any, ep: Epilogue, depthwise: bool) -> bool:
    """Can this conv run channels-first (see the module docstring), at every traced input configuration?"""
    p = e.params
    dn = p["dimension_numbers"]
    lhs_spec, rhs_spec = tuple(dn.lhs_spec), tuple(dn.rhs_spec)
    x, w = e.invars
    if len(lhs_spec) != 4 or depthwise or ep.channel_reduced or ep.pool_windows:
        return False
    if int(p.get("feature_group_count", 1)) != 1 or int(p.get("batch_group_count", 1)) != 1:
        return False
    if not _nchw_source(builder, x, lhs_spec):
        return False
    if x.aval.dtype.itemsize not in (2, 4) or w.aval.dtype != x.aval.dtype:
        return False
    for a in [e, *builder.low.traces.aligned_eqns(e)]:
        q = a.params
        if any(int(s) != 1 for s in q["window_strides"]) or any(int(d) != 1 for d in q["lhs_dilation"]):
            return False
        if any(int(d) != 1 for d in q["rhs_dilation"]) or any(int(v) for pp in q["padding"] for v in pp):
            return False
        xs = tuple(int(s) for s in a.invars[0].aval.shape)
        ws = tuple(int(s) for s in a.invars[1].aval.shape)
        c_in, width = xs[lhs_spec[1]], xs[lhs_spec[3]]
        if width % LANE or ws[rhs_spec[3]] > width or ws[rhs_spec[2]] > xs[lhs_spec[2]]:
            return False
        if c_in % 8 and a is e:  # other traces (smaller validation shapes) get zero channels padded on
            return False
    return True


def build_chw(builder: ConvBuilder, e: Any, ep: Epilogue, prec_code: str) -> tuple[KernelSpec, str]:
    """The channels-first kernel's spec and call (only when `chw_ok`)."""
    x, w = e.invars
    dn = e.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec)
    outs = builder.outputs
    s, c = builder.stem, builder.cprefix
    xn, wn = builder.low.name_of(x), builder.low.name_of(w)
    reduced = bool(ep.reductions)
    batch_reduced = ep.batch_reduced
    ax_n, ax_r = 0, 1
    xdt = dtype_name(x.aval)
    # a bf16 block of fewer than 16 channels per tap would be stacked on half sublane tiles: stack in f32
    staged = x.aval.dtype.itemsize == 2 and int(x.aval.shape[lhs_spec[1]]) % 16 != 0
    ep_refs = [f"e{k}_ref" for k in range(len(ep.inputs))]
    out_refs = [f"o{k}_ref" for k in range(len(outs))]
    ep_names = [builder.low.name_of(v) for v in ep.inputs]
    from_k = [out_spec.index(a) for a in range(4)]  # kernel (N, C, H, W) -> the conv's output layout

    piece = "xs[:, kh * width : kh * width + n_pix]"
    if staged:
        piece += ".astype(jnp.float32)"
    tap = f"pltpu.roll({piece}, n_pix - kw, 1) if kw else {piece}"
    window = f"jnp.concatenate([{tap} for kh in range(n_kh) for kw in range(n_kw)], axis=0)"
    if staged:
        window += f".astype({dtype_code(xdt)})"
    body = [
        f"r_index = pl.program_id({ax_r})",
        "start = jnp.minimum(r_index * rows, n_oh - rows)  # the last block ends at the last output row",
        "xs = x_ref[:, pl.ds(pl.multiple_of(start * width, 128), (rows + n_kh - 1) * width)]  # (C_in, pixels)",
        "n_pix = rows * width",
        f"window = {window}  # (taps * C_in, rows * W): tap (kh, kw) is the block shifted by kh rows and kw "
        "lanes; what wraps round lands past the output width",
        f"acc = jnp.dot(w_ref[...], window, preferred_element_type=jnp.float32{prec_code})  # f32[C_out, rows * W]",
    ]
    if ep.lines:
        body.append("# fused epilogue on the f32 accumulator: no HBM round trip of the conv result")
        body.extend(ep.lines)
    init: list[str] = []
    if reduced:
        first = "(pl.program_id(0) == 0) & (r_index == 0)" if batch_reduced else "r_index == 0"
        init = [f"@pl.when({first})", "def _init():"]
    store = ["def store(shift):  # output row j of the block is computed row j + shift"]
    rows_loop: list[str] = []
    finals: list[str] = []
    for k, (o, v, r) in enumerate(zip(out_refs, outs, ep.results, strict=True)):
        at = "[:, (j + shift) * width : (j + shift) * width + n_ow]"
        if r is None:
            src, prim = ep.reductions[v]
            ident = SPATIAL_REDUCTIONS[prim]
            fold = "jnp.max" if prim == "reduce_max" else "jnp.sum"
            combine = "jnp.maximum" if prim == "reduce_max" else "jnp.add"
            init.append(f"    {o}[...] = jnp.full({o}.shape, {ident}, {o}.dtype)")
            store.append(f"    red{k} = jnp.full(({o}.shape[0], 1), {ident}, jnp.float32)")
            rows_loop.append(
                f"red{k} = {combine}(red{k}, {fold}({src}{at}.astype(jnp.float32), axis=1, keepdims=True))"
            )
            finals.append(f"{o}[...] = {combine}({o}[...], red{k})  # this step's rows, each counted once")
        else:
            rows_loop.append(f"{o}[:, j, :] = {r}{at}.astype({o}.dtype)")
    store += ["    for j in range(rows - shift):", *(f"        {ln}" for ln in rows_loop)]
    store += [f"    {ln}" for ln in finals]
    store += [
        "",
        "if n_blocks * rows == n_oh:",
        "    store(0)",
        "else:  # the last block starts early: its first rows are the block before's (stored there)",
        "",
        "    @pl.when(r_index == n_blocks - 1)",
        "    def _last():",
        "        store(n_blocks * rows - n_oh)",
        "",
        "    @pl.when(r_index != n_blocks - 1)",
        "    def _others():",
        "        store(0)",
    ]
    lines = [*body[:1], *init, *([""] if init else []), *body[1:], *store]
    code_body = "\n".join(f"    {ln}" if ln else "" for ln in lines)

    grid_args = "n_index, r_index"
    ep_specs = "".join(
        f"\n            pl.BlockSpec(({'n_out' if r == 'chan' else '1'}, 1), {s}_param_index_map),"
        for r in ep.input_roles
    )
    ep_prep = "".join(
        f"    {a} = jnp.reshape({n}, ({'-1' if r == 'chan' else '1'}, 1))  # "
        f"{'per-channel epilogue operand: a column' if r == 'chan' else 'scalar epilogue operand'}\n"
        for a, n, r in zip([f"ep{k}" for k in range(len(ep.inputs))], ep_names, ep.input_roles, strict=True)
    )
    out_shapes = ", ".join(
        f"jax.ShapeDtypeStruct(({'1' if batch_reduced else 'n_b'}, n_out, 1), jnp.float32)"
        if r is None
        else f"jax.ShapeDtypeStruct((n_b, n_out, n_oh, n_ow), {dtype_code(dtype_name(v.aval))})"
        for v, r in zip(outs, ep.results, strict=True)
    )
    out_blocks = ", ".join(
        f"pl.BlockSpec((None, n_out, 1), {s}_reduced_index_map)"
        if r is None
        else f"pl.BlockSpec((None, n_out, rows, n_ow), {s}_out_index_map)"
        for r in ep.results
    )
    crops = "\n".join(
        (
            f"    out[{k}] = out[{k}][0, :, 0]  # (C_out,), over the batch and spatial dims"
            if batch_reduced
            else f"    out[{k}] = out[{k}][:, :, 0]  # (N, C_out), over the spatial dims"
        )
        if r is None
        else f"    out[{k}] = {transpose_code(f'out[{k}]', view_perm(from_k, ep.out_perms[k]))}"
        for k, r in enumerate(ep.results)
    )
    semantics = (
        '("arbitrary", "arbitrary")'
        if batch_reduced
        else '("parallel", "arbitrary")'
        if reduced
        else '("parallel", "parallel")'
    )
    w_perm = (rhs_spec[0], rhs_spec[2], rhs_spec[3], rhs_spec[1])  # -> (C_out, KH, KW, C_in)
    code = f'''def {s}_x_index_map({grid_args}):
    return (n_index, 0, 0)  # the sample's whole image: fetched once per sample


def {s}_w_index_map({grid_args}):
    return (0, 0)


def {s}_param_index_map({grid_args}):
    return (0, 0)


def {s}_out_index_map({grid_args}):
    return (n_index, 0, r_index, 0)


def {s}_reduced_index_map({grid_args}):
    return ({"0" if batch_reduced else "n_index"}, 0, 0)  # resident over the row steps: an accumulator


def {s}_kernel(x_ref, w_ref, {", ".join(ep_refs + out_refs)}, *, rows, n_kh, n_kw, width, n_oh, n_ow, n_blocks):
    """Channels-first conv: the taps' shifted windows stacked along the sublanes, one MXU matmul, NCHW rows
    stored from the lanes{", then the fused epilogue" if ep.lines else ""}."""
{code_body}


def {s}({", ".join([xn, wn, *ep_names])}):
    """Channels-first direct convolution: whole images in VMEM, one matmul per block of output rows."""
    x = {transpose_code(xn, lhs_spec)}  # (N, C, H, W): undoes the NHWC transpose before it (XLA folds the pair)
    wt = {transpose_code(wn, w_perm)}  # (C_out, KH, KW, C_in)
    n_b, n_c, n_h, width = x.shape
    n_out, n_kh, n_kw = wt.shape[0], wt.shape[1], wt.shape[2]
    n_oh, n_ow = n_h - n_kh + 1, width - n_kw + 1
    if n_c % 8:  # only at a shape smaller than the task's (whose channels tile the sublanes): zeros add nothing
        x = jnp.pad(x, ((0, 0), (0, -n_c % 8), (0, 0), (0, 0)))
        wt = jnp.pad(wt, ((0, 0), (0, 0), (0, 0), (0, -n_c % 8)))
        n_c = x.shape[1]
    rows = _block(n_oh, {c}BLOCK_ROWS, 8)
    rows = n_oh if rows >= n_oh or rows % 8 else rows
    n_blocks = -(-n_oh // rows)
    x = x.reshape(n_b, n_c, n_h * width)  # the pixels on the lanes: a free reshape
    wt = wt.reshape(n_out, n_kh * n_kw * n_c)  # rows of taps x channels: the window's stacking order
{ep_prep}    out_shape = [{out_shapes}]
    cost = pl.CostEstimate(
        flops=2 * n_b * n_oh * width * n_kh * n_kw * n_c * n_out,
        transcendentals=0,
        bytes_accessed=_nbytes(x, wt, *out_shape),
    )
    out = list(pl.pallas_call(
        functools.partial(
            {s}_kernel, rows=rows, n_kh=n_kh, n_kw=n_kw, width=width, n_oh=n_oh, n_ow=n_ow, n_blocks=n_blocks
        ),
        grid=(n_b, n_blocks),
        in_specs=[
            pl.BlockSpec((None, n_c, n_h * width), {s}_x_index_map),
            pl.BlockSpec((n_out, n_kh * n_kw * n_c), {s}_w_index_map),{ep_specs}
        ],
        out_specs=[{out_blocks}],
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics={semantics},
            vmem_limit_bytes={c}VMEM_LIMIT_BYTES,
        ),
        cost_estimate=cost,
    )(x, wt{"".join(f", ep{k}" for k in range(len(ep.inputs)))}))
{crops}
    return {", ".join(f"out[{k}]" for k in range(len(outs)))}
'''
    xs = tuple(int(v) for v in x.aval.shape)
    ws = tuple(int(v) for v in w.aval.shape)
    n_b, c_in, h, width = (xs[d] for d in lhs_spec)
    c_out, kh, kw = ws[rhs_spec[0]], ws[rhs_spec[2]], ws[rhs_spec[3]]
    oh, ow = h - kh + 1, width - kw + 1
    taps = kh * kw
    params = [
        ParamSpec(
            name=f"{c}BLOCK_ROWS",
            role="sublane",
            align=8,
            extent=oh,
            default=0,
            doc="output rows per grid step (every output channel)",
        )
    ]
    pr = DimRef(kind="param", param=params[0].name, extent=oh, align=8)
    full = lambda n: DimRef(kind="full", extent=n)  # noqa: E731
    pixels = DimRef(kind="param", param=params[0].name, extent=oh * width, align=8 * width)
    buffers = [
        BufferSpec(
            what="the sample's whole image (C_in, H * W)",
            dims=[full(c_in), full(h * width)],
            itemsize=x.aval.dtype.itemsize,
            kind="input",
            axes=[ax_n],
            hbm_bytes=nbytes(x),
        ),
        BufferSpec(
            what="weights (C_out, taps * C_in)",
            dims=[full(c_out), full(taps * c_in)],
            itemsize=w.aval.dtype.itemsize,
            kind="input",
            axes=[],
            hbm_bytes=nbytes(w),
        ),
        *(
            BufferSpec(
                what="per-channel epilogue operand" if r == "chan" else "scalar epilogue operand",
                dims=[full(c_out if r == "chan" else 1), full(1)],
                itemsize=v.aval.dtype.itemsize,
                kind="input",
                axes=[],
                hbm_bytes=nbytes(v),
            )
            for v, r in zip(ep.inputs, ep.input_roles, strict=True)
        ),
        *(
            BufferSpec(
                what="output block (C_out, rows, W_out)",
                dims=[full(c_out), pr, full(ow)],
                itemsize=o.aval.dtype.itemsize,
                kind="output",
                axes=[ax_n, ax_r],
                hbm_bytes=nbytes(o),
            )
            if r is not None
            else BufferSpec(
                what="spatially reduced (C_out, 1) block",
                dims=[full(c_out), full(1)],
                itemsize=4,
                kind="output",
                axes=[] if batch_reduced else [ax_n],
                hbm_bytes=nbytes(o),
            )
            for o, r in zip(outs, ep.results, strict=True)
        ),
        BufferSpec(
            what="the taps' windows stacked (taps * C_in, rows * W), in VMEM",
            dims=[full(taps * c_in), pixels],
            itemsize=4 if staged else x.aval.dtype.itemsize,
            copies=1,
            kind="temporary",
        ),
        BufferSpec(
            what="f32 accumulator (C_out, rows * W)",
            dims=[full(c_out), pixels],
            itemsize=4,
            copies=2,
            kind="temporary",
        ),
    ]
    flops = 2.0 * n_b * oh * width * taps * c_in * c_out  # the columns past W_out are computed too
    spec = KernelSpec(
        name=s,
        family=builder.family,
        title=f"2-D convolution channels-first (NCHW, no transposes): {taps} taps stacked along the sublanes, "
        "one matmul per block of output rows",
        code=code,
        params=params,
        grid=[
            GridAxis(
                name="n_index", extent=n_b, param=None, semantics="arbitrary" if batch_reduced else "parallel"
            ),
            GridAxis(
                name="r_index",
                extent=oh,
                param=params[0].name,
                align=8,
                semantics="arbitrary" if reduced else "parallel",
            ),
        ],
        buffers=buffers,
        flops=flops,
        structure=(
            "grid (batch, output-row blocks): each step reads its rows' taps from the sample's whole image "
            "(fetched once per sample), stacks them along the sublanes in VMEM, runs one MXU matmul for every "
            "output channel"
            + (", the fused epilogue" if ep.lines else "")
            + " and stores NCHW rows"
            + (", accumulating the spatial reductions across row steps" if reduced else "")
        ),
        notes=[
            "channels-first: the input is read in its own NCHW layout and the output written in it, so no "
            "transpose, pad or crop runs outside the kernel",
            f"the {kw - 1} columns past the output width are computed (the taps wrap round there), not stored",
        ],
    )
    return spec, f"{s}({', '.join([xn, wn, *ep_names])})"
