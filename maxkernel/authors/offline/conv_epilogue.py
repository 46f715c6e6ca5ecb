"""Elementwise epilogues fused into the direct convolution kernel (bias, scale, clamp, activations, casts).

Without this, a `conv -> + bias -> activation` chain is two kernels: the conv writes its f32 result to HBM
and a map kernel reads it back, applies the chain and writes again. XLA fuses such an epilogue into its
convolution, so the unfused chain starts a full f32 round trip behind. Here the chain runs on the conv's f32
accumulator in VMEM, right before the kernel's single store.

The kernel holds a block of the conv output as a 2-D `(pixels, block_o)` array (channels last), so the
values an epilogue may use are exactly those that broadcast against it without a relayout:

* **block**: the conv output's own shape (the accumulator, or what the chain made of it);
* **chan**: one value per output channel (a bias, a per-channel scale): a `(1, block_o)` block of a
  `(1, C_out)` copy that the wrapper pads like the weights' channels;
* **scalar**: one value (a literal, or a rank-0 input as a `(1, 1)` block).

Sums and maxima of a block over the spatial dims (with or without the batch) are accumulated in resident
output blocks across the grid (`SPATIAL_REDUCTIONS`); nothing in the kernel may read them. Anything else (a
full-size second operand, an iota, another reduction) stays out of the conv region, which keeps the
partition's old behaviour for it: the value is written once and the next kernel reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from maxkernel.authors.offline.dataflow import is_literal
from maxkernel.authors.offline.emit import EmitError, dtype_code, dtype_name, elementwise_expr, literal_code

if TYPE_CHECKING:
    from maxkernel.authors.offline.partition import Partition, Region

Role = Literal["block", "chan", "scalar", "pixel"]

LAYOUT_PRIMITIVES = frozenset(
    {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "copy", "copy_p", "stop_gradient"}
)
"""Layout ops that only relabel a chan/scalar value (or broadcast it to the block): aliases in the kernel."""

EXCLUDED = frozenset({"iota", "rng_bit_generator", "random_bits", "erf_inv"})
"""Elementwise-kind primitives the epilogue does not emit (an iota needs index arithmetic on the block)."""


SPATIAL_REDUCTIONS = {"reduce_sum": "0.0", "reduce_max": "-jnp.inf"}
"""Reductions over all spatial dims (a spatial sum, a global pool), or over the batch too, that the kernel
accumulates across its output-row (and batch) steps, with their identity: an `(N, C_out)` or `(C_out,)`
result. The block itself is written only when something else reads it (a norm's statistics, see
moments.py: the sums come out of the same pass that writes the conv output)."""

CHANNEL_REDUCTIONS = {"reduce_sum": "jnp.sum", "reduce_max": "jnp.max"}
"""Reductions over the channel dim alone (a softmax or a layer norm over the channels after a conv): one
value per pixel, a `(pixels, 1)` column of the block, complete within one grid step because the kernel then
takes every output channel in one block (the whole dim, unpadded, so no lane needs masking). Unlike spatial
reductions the rest of the epilogue may read them (`pixel` values)."""


@dataclass(frozen=True)
class ConvOut:
    """The conv output's shape in the reference's layout and which of its dims holds the channels.

    A transpose of a block (the NHWC -> NCHW transpose of PyTorch-layout code) gives another view of the same
    kernel block: `perm` says which dim of the conv's own output each of its dims is (None: the conv's
    layout). The kernel's block does not move; only the shapes of the operands that broadcast against it, the
    dims a reduction names and the wrapper's final layout of a stored result follow the view."""

    shape: tuple[int, ...]
    channel_dim: int
    batch_dim: int = 0
    perm: tuple[int, ...] | None = None

    def permuted(self, perm: tuple[int, ...]) -> ConvOut:
        """The view after `transpose(block, perm)`."""
        base = self.perm or tuple(range(len(self.shape)))
        return ConvOut(
            shape=tuple(self.shape[p] for p in perm),
            channel_dim=perm.index(self.channel_dim),
            batch_dim=perm.index(self.batch_dim),
            perm=tuple(base[p] for p in perm),
        )

    @property
    def spatial_dims(self) -> tuple[int, ...]:
        return tuple(d for d in range(len(self.shape)) if d not in (self.batch_dim, self.channel_dim))

    @property
    def reduced_shape(self) -> tuple[int, int]:
        return (self.shape[self.batch_dim], self.channels)

    @property
    def channels(self) -> int:
        return self.shape[self.channel_dim]

    def role(self, shape: tuple[int, ...]) -> Role | None:
        """How a value of this shape lives in the kernel, or None when it cannot."""
        if shape == self.shape:
            return "block"
        if math.prod(shape) == 1:
            return "scalar"
        if shape == (self.channels,):
            return "chan"
        if len(shape) == len(self.shape) and all(
            s == (self.channels if d == self.channel_dim else 1) for d, s in enumerate(shape)
        ):
            return "chan"
        lead = len(self.shape) - len(shape)  # fewer dims: aligned to the trailing ones, as numpy broadcasts
        if 1 < len(shape) < len(self.shape) and all(
            s == (self.channels if d + lead == self.channel_dim else 1) for d, s in enumerate(shape)
        ):
            return "chan"  # a PyTorch-layout bias: (C, 1, 1) against (N, C, H, W)
        if shape in (self.pixel_shape, self.pixel_shape_keepdims):
            return "pixel"
        return None

    @property
    def pixel_shape(self) -> tuple[int, ...]:
        """One value per pixel: the conv output without its channel dim."""
        return tuple(s for d, s in enumerate(self.shape) if d != self.channel_dim)

    @property
    def pixel_shape_keepdims(self) -> tuple[int, ...]:
        return tuple(1 if d == self.channel_dim else s for d, s in enumerate(self.shape))


def view_perm(to_conv: list[int], view: tuple[int, ...] | None) -> tuple[int, ...]:
    """The transpose from a kernel's result to a stored output's layout: `to_conv` lays the result out as the
    conv's own output (per conv-output dim, the result dim it is); `view` (`ConvOut.perm`) is the output's
    view of that, None for the conv's own layout."""
    return tuple(to_conv) if view is None else tuple(to_conv[q] for q in view)


def conv_out_of(conv_eqn: Any) -> ConvOut:
    shape = tuple(int(s) for s in conv_eqn.outvars[0].aval.shape)
    spec = conv_eqn.params["dimension_numbers"].out_spec
    return ConvOut(shape=shape, channel_dim=int(spec[1]), batch_dim=int(spec[0]))


def block_views(g: Any, conv_eqn: Any, eqns: list[int]) -> dict[Any, ConvOut]:
    """The view (layout) of every full-size block value among `eqns` (program order): the conv output in its
    own layout, what a transpose makes of a block, and what elementwise work on a block keeps."""
    base = conv_out_of(conv_eqn)
    views: dict[Any, ConvOut] = {conv_eqn.outvars[0]: base}
    for j in sorted(eqns):
        e = g.eqns[j]
        if e is conv_eqn:
            continue
        src = [views[v] for v in e.invars if not is_literal(v) and v in views]
        if not src:
            continue
        if e.primitive.name == "transpose":
            views[e.outvars[0]] = src[0].permuted(tuple(int(a) for a in e.params["permutation"]))
            continue
        for ov in e.outvars:
            if _shape(ov) == src[0].shape:
                views[ov] = src[0]
    return views


def eqn_view(views: dict[Any, ConvOut], e: Any, base: ConvOut) -> ConvOut:
    """The view an equation works in: that of its block operands (the conv's own when it reads none)."""
    for v in e.invars:
        if not is_literal(v) and v in views:
            return views[v]
    return base


def mixes_views(views: dict[Any, ConvOut], e: Any) -> bool:
    """Does the equation combine blocks of two different views? (Same shapes, different elements: a square
    NHWC block plus its NCHW transpose.)"""
    perms = {views[v].perm for v in e.invars if not is_literal(v) and v in views}
    return len(perms) > 1


def spatial_reduction_ok(out: ConvOut, e: Any, produced: set[Any]) -> bool:
    """A sum/max of an epilogue block over every spatial dim, to (N, C_out) in that order, or over the batch
    dim too, to (C_out,) (a batch norm's statistics); in f32."""
    if e.primitive.name not in SPATIAL_REDUCTIONS:
        return False
    src = e.invars[0]
    if src not in produced or out.role(_shape(src)) != "block":
        return False
    axes = tuple(sorted(int(a) for a in e.params["axes"]))
    if axes == out.spatial_dims:
        if out.batch_dim > out.channel_dim or _shape(e.outvars[0]) != out.reduced_shape:
            return False
    elif axes != tuple(sorted((*out.spatial_dims, out.batch_dim))) or _shape(e.outvars[0]) != (out.channels,):
        return False
    return dtype_name(e.outvars[0].aval) == "float32"


def channel_reduction_ok(out: ConvOut, e: Any, produced: set[Any]) -> bool:
    """A sum/max of an epilogue block over the channel dim alone, to one value per pixel, in f32."""
    if e.primitive.name not in CHANNEL_REDUCTIONS:
        return False
    src = e.invars[0]
    if src not in produced or out.role(_shape(src)) != "block":
        return False
    if tuple(int(a) for a in e.params["axes"]) != (out.channel_dim,):
        return False
    return out.role(_shape(e.outvars[0])) == "pixel" and dtype_name(e.outvars[0].aval) == "float32"


def is_channel_reduction(out: ConvOut, e: Any) -> bool:
    return e.primitive.name in CHANNEL_REDUCTIONS and tuple(int(a) for a in e.params["axes"]) == (
        out.channel_dim,
    )


def reduces_batch(out: ConvOut, e: Any) -> bool:
    """Does this spatial reduction also sum over the batch dim (one (C_out,) result for the whole batch)?"""
    return out.batch_dim in {int(a) for a in e.params["axes"]}


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in v.aval.shape)


def literals_fixed(traces: Any, e: Any) -> bool:
    """Every literal operand has one value in every input configuration (a `1 / (H * W)` of a mean does
    not: it stays in a kernel whose literal resolution expresses it from the shapes)."""
    others = traces.aligned_eqns(e)
    for k, v in enumerate(e.invars):
        if is_literal(v) and any(
            np.asarray(a.invars[k].val).tolist() != np.asarray(v.val).tolist() for a in others
        ):
            return False
    return True


def _eqn_ok(out: ConvOut, e: Any, *, owned: bool) -> bool:
    """Can the kernel emit this equation? Owned ones must produce a block; pulled ones (floats on inputs)
    any role."""
    name = e.primitive.name
    if name in EXCLUDED:
        return False
    roles = [out.role(_shape(v)) for v in e.outvars]
    if None in roles or (owned and any(r not in ("block", "pixel") for r in roles)):
        return False
    for v in e.invars:
        if not is_literal(v) and out.role(_shape(v)) is None:
            return False
    if name == "broadcast_in_dim":
        src = e.invars[0]
        if out.role(_shape(src)) == "chan" and len(_shape(src)) == 1:
            # a (C,) vector must land on the channel dim (a W-long vector of the same length must not)
            return tuple(e.params["broadcast_dimensions"]) == (out.channel_dim,)
        if out.role(_shape(src)) == "chan" and len(_shape(src)) < len(out.shape) and out.channels > 1:
            # (C, 1, 1): its C-long dim must land on the channel dim
            dims = tuple(int(d) for d in e.params["broadcast_dimensions"])
            return dims[_shape(src).index(out.channels)] == out.channel_dim
        if out.role(_shape(src)) == "pixel":
            # a per-pixel value keeps its dims in order around the channel dim (a (pixels, 1) column)
            keep = [d for d in range(len(out.shape)) if d != out.channel_dim]
            dims = tuple(int(d) for d in e.params["broadcast_dimensions"])
            if len(_shape(src)) == len(keep):
                return dims == tuple(keep)
            return dims == tuple(range(len(out.shape)))
    return True


def epilogue_ok(part: Partition, region: Region, i: int, kind: str) -> bool:
    """May owned equation `i` join the conv region as part of its epilogue?"""
    g = part.g
    conv = g.eqns[min(region.owned)]
    base = conv_out_of(conv)
    e = g.eqns[i]
    views = block_views(g, conv, region.eqns())
    out = eqn_view(views, e, base)
    produced = part.produced_in(region)
    reductions = [
        g.eqns[j]
        for j in region.owned
        if g.kind[j] == "reduce" and not is_channel_reduction(eqn_view(views, g.eqns[j], base), g.eqns[j])
    ]
    reduced = {v for r in reductions for v in r.outvars}
    if any(not is_literal(v) and v in reduced for v in e.invars):
        return False  # a reduction is accumulated over the grid: nothing in the kernel may read it
    if mixes_views(views, e):
        return False
    if kind == "reduce":
        src = g.producer.get(e.invars[0])
        if src not in region.owned:
            return False
        if is_channel_reduction(out, e):
            return channel_reduction_ok(out, e, produced)  # complete within a step: a per-pixel value
        if any(reduces_batch(eqn_view(views, r, base), r) != reduces_batch(out, e) for r in reductions):
            return False  # one grid order for all of them: per sample, or over the whole batch
        return spatial_reduction_ok(out, e, produced)
    if kind not in ("elementwise", "absorbed"):
        return False
    if e.primitive.name == "transpose":
        # another view of a block (NHWC -> NCHW): free in the kernel, the wrapper lays out what is stored
        return e.invars[0] in views and e.invars[0] in produced
    if kind == "absorbed" and e.primitive.name not in LAYOUT_PRIMITIVES | {"convert_element_type"}:
        return False
    if not _eqn_ok(out, e, owned=True) or not literals_fixed(g.traces, e):
        return False
    for v in e.invars:
        if is_literal(v) or v in produced:
            continue
        closure = part.float_closure(v)
        if not closure:
            if out.role(_shape(v)) == "block":
                return False  # a full-size operand read from HBM: not this template
            continue
        for p in closure:
            pe = g.eqns[p]
            if g.kind[p] not in ("elementwise", "absorbed") or not _eqn_ok(out, pe, owned=False):
                return False
            if not literals_fixed(g.traces, pe):
                return False
            for u in pe.invars:
                if not is_literal(u) and g.producer.get(u) not in closure and out.role(_shape(u)) == "block":
                    return False
    return True


@dataclass
class Epilogue:
    """The code of a fused epilogue: extra kernel inputs, and the lines that turn `acc` into the outputs."""

    inputs: list[Any]  # region inputs beyond x and w, each a chan or scalar value
    input_roles: list[Role]
    lines: list[str]  # kernel lines on the accumulator `acc`
    results: list[str | None]  # per region output: the block expression to store; None for a reduction
    reductions: dict[Any, tuple[str, str]] = field(default_factory=dict)
    """Per reduced output var: (the reduced block's expression, the reduce primitive)."""
    batch_reduced: bool = False  # the reductions also sum over the batch: (C_out,) results, not (N, C_out)
    channel_reduced: bool = False  # reduces over the channels: one block holds every channel (the whole dim)
    pool_windows: tuple[int, ...] | None = (
        None  # (rows, columns) windows of a pool fused after the conv (conv_pool)
    )
    out_perms: list[tuple[int, ...] | None] = field(default_factory=list)
    """Per region output: the view it is stored in (`ConvOut.perm`: which conv-output dim each of its dims
    is), None for the conv's own layout or a reduction."""


def build_epilogue(builder: Any, conv_eqn: Any, in_refs: list[str], pack: int = 1) -> Epilogue:
    """Emit the region's equations after the conv, in program order, on the accumulator `acc`.

    `pack` > 1: each row of the block holds `pack` adjacent output columns (conv_kernel.lane_pack), every
    channel of each in its own lane group; a channel reduction then reduces each group and broadcasts the
    result back over it, and a pool's W window (which must be `pack` columns) combines a row's groups."""
    part, region = builder.part, builder.region
    g = part.g
    base = conv_out_of(conv_eqn)
    conv_var = conv_eqn.outvars[0]
    extra = [v for v in builder.inputs if v not in conv_eqn.invars]
    roles: list[Role] = []
    code: dict[Any, str] = {}
    lines: list[str] = []
    cdt = dtype_name(conv_var.aval)
    code[conv_var] = "acc" if cdt == "float32" else f"acc.astype({dtype_code(cdt)})"
    order = sorted(set(region.owned) | set(region.pulled))
    views = block_views(g, conv_eqn, order)

    def consumer_view(v: Any) -> ConvOut:
        """The view of the first region equation that reads `v` (an operand's shape is read in it)."""
        for p in order:
            if any(u is v for u in g.eqns[p].invars):
                owned_use = [c for u in g.eqns[p].outvars for c in g.consumers.get(u, []) if c in order]
                if p in region.owned or not owned_use:
                    return eqn_view(views, g.eqns[p], base)
                return consumer_view(g.eqns[p].outvars[0])
        return base

    for v, ref in zip(extra, in_refs, strict=True):
        role = consumer_view(v).role(_shape(v))
        if role not in ("chan", "scalar"):
            raise EmitError("a conv epilogue operand that is neither per-channel nor a scalar")
        roles.append(role)
        code[v] = f"{ref}[...]"
    n = 0
    reductions: dict[Any, tuple[str, str]] = {}
    batch_reduced = False
    channel_reduced = False
    pool_windows: tuple[int, ...] | None = None
    split: Any = None  # the pooling split's output var
    for p in order:
        e = g.eqns[p]
        if e is conv_eqn:
            continue
        args = []
        for v in e.invars:
            if is_literal(v):
                if not literals_fixed(g.traces, e):
                    raise EmitError("a conv epilogue literal that changes with the input shapes")
                args.append(literal_code(v.val, dtype_name(v.aval)))
            else:
                args.append(code[v])
        name = e.primitive.name
        ov = e.outvars[0]
        out = eqn_view(views, e, base) if p in region.owned else consumer_view(ov)
        if mixes_views(views, e):
            raise EmitError("a conv epilogue equation combining two layouts of the block")
        if name == "transpose" and e.invars[0] in views:
            code[ov] = args[0]  # another view of the same block: the kernel's block does not move
            continue
        if name == "reshape" and out.perm is None and _shape(e.invars[0]) == out.shape:
            from maxkernel.authors.offline.conv_pool import pool_split  # conv_pool imports this module

            windows = pool_split(out, _shape(e.invars[0]), _shape(ov))
            if windows is not None:
                if pool_windows is not None:
                    raise EmitError("two pools of one conv output")
                pool_windows, split = windows, ov
                code[ov] = args[0]  # the block itself; the window reduction does the split
                continue
        if split is not None and e.invars[0] is split:
            from maxkernel.authors.offline.conv_pool import POOL_REDUCTIONS

            assert pool_windows is not None
            fold = POOL_REDUCTIONS[name]
            *pd, ph, pw = (
                pool_windows  # 3-D: the depth window is combined across planes (conv_kernel's carry)
            )
            lead = "rows" if not pd else "n_oh"  # 2-D: the block's rows; 3-D: one plane's rows
            if pack > 1 and pw != pack:
                raise EmitError("a pool whose W window is not the lane packing")
            cols = "n_ow_g" if pack > 1 else "n_ow_p"  # packed: groups of `pack` columns
            n += 1
            local = f"ep{n}"
            lines.append(f"{local} = {args[0]}.reshape({lead}, {cols}, {args[0]}.shape[-1])  # (rows, W, bo)")
            if ph > 1:
                lines.append(
                    f"{local} = {fold}({local}.reshape({lead} // {ph}, {ph}, {cols}, {local}.shape[-1]), axis=1)  "
                    f"# {ph}-row windows: a split of the leading axis"
                )
            if pack > 1:
                combine = "jnp.maximum" if name == "reduce_max" else "jnp.add"
                lines.append(
                    f"{local} = functools.reduce({combine}, [{local}[..., q * ({local}.shape[-1] // pack) : (q + 1) "
                    f"* ({local}.shape[-1] // pack)] for q in range(pack)])  # {pw}-column windows: the lane groups "
                    "of a packed row, float32 pooled block"
                )
            elif pw > 1:
                lines.append(
                    f"{local} = {fold}({local}.reshape({local}.shape[0], n_ow_p // {pw}, {pw}, {local}.shape[-1]), "
                    f"axis=2)  # {pw}-column windows along the sublanes: float32 pooled block"
                )
            if pd and pd[0] > 1:
                combine = "jnp.maximum" if name == "reduce_max" else "jnp.add"
                lines += [
                    f"{local} = jnp.where(lax.rem(plane, {pd[0]}) == 0, {local}, {combine}(carry, {local}))  # the "
                    f"{pd[0]}-plane depth window so far",
                    f"carry = {local}",
                ]
            code[ov] = local
            continue
        if is_channel_reduction(out, e):
            fold = CHANNEL_REDUCTIONS[name]
            n += 1
            local = f"ep{n}"
            if pack > 1:
                group = f"({local}.shape[-1] // pack)"
                lines += [
                    f"{local} = {args[0]}",
                    f"{local} = jnp.concatenate([jnp.broadcast_to({fold}({local}[:, q * {group} : (q + 1) * {group}], "
                    f"axis=-1, keepdims=True), ({local}.shape[0], {group})) for q in range(pack)], axis=-1)  # float32 "
                    "pixel: over each packed column's channels (a lane group), broadcast back over the group",
                ]
            else:
                lines.append(
                    f"{local} = {fold}({args[0]}, axis=-1, keepdims=True)  # float32 pixel: over the block's "
                    "channels, all of them (the block is the whole channel dim)"
                )
            code[ov] = local
            channel_reduced = True
            continue
        if name in SPATIAL_REDUCTIONS:
            reductions[ov] = (args[0], name)
            batch_reduced = reduces_batch(out, e)
            continue
        if name in LAYOUT_PRIMITIVES:
            code[ov] = args[0]  # chan/scalar values already broadcast against the (pixels, block_o) block
            continue
        expr = elementwise_expr(e, args, dtype_name(ov.aval), [dtype_name(v.aval) for v in e.invars], False)
        n += 1
        local = f"ep{n}"
        lines.append(f"{local} = {expr}  # {dtype_name(ov.aval)} {out.role(_shape(ov)) or 'pooled'}")
        code[ov] = local
    if any(
        v not in reductions
        and v not in views
        and any(w.role(_shape(v)) == "pixel" for w in {base, *views.values()})
        for v in builder.outputs
    ):
        raise EmitError("a per-pixel value of the conv epilogue is needed outside the kernel")
    results = [None if v in reductions else code.get(v) for v in builder.outputs]
    out_perms = [views[v].perm if v in views and v not in reductions else None for v in builder.outputs]
    if pool_windows is not None and any(q is not None for q in out_perms):
        raise EmitError("a pool and a transposed layout of one conv output")
    return Epilogue(
        out_perms=out_perms,
        inputs=extra,
        input_roles=roles,
        lines=lines,
        results=results,
        reductions=reductions,
        batch_reduced=batch_reduced,
        channel_reduced=channel_reduced,
        pool_windows=pool_windows,
    )
