"""Pooling after a 2-D convolution, fused into the conv kernel: the kernel writes the pooled block.

A reference pools by splitting each spatial dim into (out, window) and reducing the window dims,
`reduce_sum(reshape(y, (N, H // 2, 2, W // 2, 2, C)), (2, 4)) / 4` for a 2x2 average pool. The split is a
real layout op, so the partitioner leaves it outside kernels, and the conv kernel writes its whole f32
output to HBM for a row-wise kernel to read back and reduce: a round trip of the largest tensor in the
program (308 MB of f32 for a 32x112x112x192 conv) to produce one a quarter its size.

`absorb_pools` (run after the partition) moves such a split, its window reduction and the row-wise
region's elementwise tail (the mean's division, a cast) into the conv region. The conv kernel then pools
its block in VMEM, rows by a split of the leading (row) axis and columns by a split of the sublane axis,
and stores the pooled block: HBM sees the pooled output only. The row block is a multiple of the row
window and the padded width a multiple of the column window, so a window never mixes valid and padded
pixels; padded pooled rows/columns are cropped like the conv's own.

A 3-D conv's kernel computes one output plane at a time: it pools each plane's rows and columns the same
way and combines the depth window across consecutive planes in the plane loop's carry, storing the running
pooled plane after each plane (the last plane of a window stores the finished value); the plane block is a
multiple of the depth window.

Only convs with the batch first and the channels last (NHWC / NDHWC), sums and maxima, windows equal to
their strides (non-overlapping), and a tail of elementwise ops with per-channel or scalar operands.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from maxkernel.authors.offline.conv_epilogue import (
    EXCLUDED,
    LAYOUT_PRIMITIVES,
    ConvOut,
    conv_out_of,
    is_channel_reduction,
    literals_fixed,
)
from maxkernel.authors.offline.dataflow import is_literal

if TYPE_CHECKING:
    from maxkernel.authors.offline.partition import Partition

POOL_REDUCTIONS = {"reduce_sum": "jnp.sum", "reduce_max": "jnp.max"}


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in v.aval.shape)


def pool_split(
    out: ConvOut, src_shape: tuple[int, ...], dst_shape: tuple[int, ...]
) -> tuple[int, ...] | None:
    """The window per spatial dim of a reshape that splits each spatial dim of an NHWC / NDHWC conv output
    into (dim // window, window) (a window of 1 keeps the dim whole), or None when it is anything else."""
    last = len(src_shape) - 1
    if len(src_shape) not in (4, 5) or out.batch_dim != 0 or out.channel_dim != last:
        return None
    windows: list[int] = []
    j = 0
    for d, n in enumerate(src_shape):
        if d in (0, last):
            if j >= len(dst_shape) or dst_shape[j] != n:
                return None
            j += 1
            continue
        if j + 1 < len(dst_shape) and dst_shape[j] * dst_shape[j + 1] == n and dst_shape[j + 1] > 1:
            windows.append(dst_shape[j + 1])
            j += 2
        elif j < len(dst_shape) and dst_shape[j] == n:
            windows.append(1)
            j += 1
        else:
            return None
    if j != len(dst_shape) or all(w == 1 for w in windows):
        return None
    return tuple(windows)


def window_axes(windows: tuple[int, ...]) -> tuple[int, ...]:
    """Positions of the window dims in the split shape (batch, [H // ph, ph], [W // pw, pw], C)."""
    axes, j = [], 1
    for w in windows:
        if w > 1:
            axes.append(j + 1)
            j += 2
        else:
            j += 1
    return tuple(axes)


def pool_of(part: Partition, conv_eqn: Any, reshape: Any) -> tuple[int, ...] | None:
    """The windows of a pooling split of the conv output, the same in every traced configuration."""
    out = conv_out_of(conv_eqn)
    got = pool_split(out, _shape(reshape.invars[0]), _shape(reshape.outvars[0]))
    if got is None:
        return None
    for a in part.g.traces.aligned_eqns(reshape):
        if pool_split(out, _shape(a.invars[0]), _shape(a.outvars[0])) != got:
            return None
    return got


def pooled_shape(out: ConvOut, windows: tuple[int, ...]) -> tuple[int, ...]:
    return (out.shape[0], *(n // w for n, w in zip(out.shape[1:-1], windows, strict=True)), out.shape[-1])


def absorb_pools(part: Partition) -> None:
    """Move `reshape -> window reduction -> elementwise tail` regions into the conv region they read."""
    g = part.g
    for cid, conv in list(part.regions.items()):
        if conv.kind != "conv" or cid not in part.regions:
            continue
        conv_eqn = g.eqns[min(conv.owned)]
        out = conv_out_of(conv_eqn)
        if any(g.kind[j] == "reduce" and not is_channel_reduction(out, g.eqns[j]) for j in conv.owned):
            continue  # a spatial reduction already walks the rows in order; keep one template at a time
        if any(g.eqns[j].primitive.name == "transpose" for j in conv.owned):
            continue  # a transposed view of the block: pools are read in the conv's own layout only
        produced = part.produced_in(conv)
        for v in sorted(produced, key=lambda u: str(u)):
            cons = g.consumers.get(v, [])
            if _shape(v) != out.shape or v in g.out_set or len(cons) != 1:
                continue
            (r,) = cons
            e_r = g.eqns[r]
            if e_r.primitive.name != "reshape" or part.status[r] != "glue" or r in part.owner:
                continue
            windows = pool_of(part, conv_eqn, e_r)
            if windows is None:
                continue
            moved = _pool_region(part, out, e_r, windows)
            if moved is None:
                continue
            rid, owned, pulled = moved
            part.status[r] = "owned"
            conv.owned.extend([r, *owned])
            conv.pulled.update(pulled)
            for i in [r, *owned]:
                part.owner[i] = cid
            del part.regions[rid]
            break


def _pool_region(
    part: Partition, out: ConvOut, reshape: Any, windows: tuple[int, ...]
) -> tuple[int, list[int], set[int]] | None:
    """The region that reduces the split's windows, when all it does besides is elementwise on the pooled
    values with per-channel or scalar operands: (its id, owned equations, pulled equations)."""
    g = part.g
    cons = g.consumers.get(reshape.outvars[0], [])
    if len(cons) != 1 or cons[0] not in part.owner:
        return None
    q = cons[0]
    e_q = g.eqns[q]
    if e_q.primitive.name not in POOL_REDUCTIONS:
        return None
    if tuple(sorted(int(a) for a in e_q.params["axes"])) != window_axes(windows):
        return None
    if str(e_q.outvars[0].aval.dtype) != "float32":
        return None
    rid = part.owner[q]
    region = part.regions[rid]
    pooled = pooled_shape(out, windows)
    inside = {v for i in region.eqns() for v in g.eqns[i].outvars}
    for i in region.eqns():
        if i == q:
            continue
        e = g.eqns[i]
        kind = g.kind[i]
        if e.primitive.name in EXCLUDED or kind not in ("elementwise", "absorbed"):
            return None
        if kind == "absorbed" and e.primitive.name not in LAYOUT_PRIMITIVES | {"convert_element_type"}:
            return None
        if not literals_fixed(g.traces, e):
            return None
        if i in region.owned and any(_shape(v) != pooled for v in e.outvars):
            return None
        for v in e.invars:
            if is_literal(v) or v in inside:
                continue
            if out.role(_shape(v)) not in ("chan", "scalar"):
                return None
    for i in region.owned:
        for v in g.eqns[i].outvars:
            used_outside = v in g.out_set or any(c not in region.eqns() for c in g.consumers.get(v, []))
            if used_outside and _shape(v) != pooled:
                return None
    return rid, list(region.owned), set(region.pulled)
