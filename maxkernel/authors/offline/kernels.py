"""Write one `pallas_call` per region: the kernel body, named index maps and the wrapper around it.

Every region is laid out on a small iteration space of *space dims*. A space dim is one axis class, or
several classes merged when every operand spans all or none of them, with a role:

* ``grid``: walked one element per grid step and squeezed out of the blocks (batch, heads);
* ``tiled``: walked in blocks of a tunable size (rows of a matmul, query blocks);
* ``seq``: tiled too, but walked innermost and sequentially, with state in VMEM scratch (K of a matmul,
  key blocks of attention);
* ``full``: whole in every block (the row a softmax reduces over, a head dim).

Each operand is transposed and reshaped outside the kernel (plain XLA layout work) into its *view*: the
space dims it is indexed by, with size-1 dims where it does not vary. Its block shape and index map
follow from the view, so the kernel body can use plain NumPy broadcasting on blocks. Tiled dims that do not
divide their block are zero-padded outside and the results cropped; where padding could change a result
(padded keys in a softmax) the kernel masks it.

Kernel bodies are re-emitted from the region's jaxpr equations (see `emit.py`), demand-driven from the
values each phase needs: operand loads and their casts at every step, the accumulators' updates, and the
epilogue at the last step of the sequential axis.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from maxkernel.authors.offline.axes import Node
from maxkernel.authors.offline.dataflow import is_literal, reduced_axes
from maxkernel.authors.offline.emit import (
    EmitError,
    dtype_code,
    dtype_name,
    elementwise_expr,
    int_tuple,
    is_float,
    literal_code,
    shape_comment,
)
from maxkernel.authors.offline.partition import Region
from maxkernel.authors.offline.spec import BufferSpec, DimRef, GridAxis, KernelSpec, ParamSpec
from maxkernel.authors.offline.trace import Atom

if TYPE_CHECKING:
    from maxkernel.authors.offline.lower import Lowering


TOPK_MAX_K = 64
"""Largest k of a `lax.top_k` a kernel computes by k rounds of (max, first argmax, knock-out): each round
is a pass over the whole row, unrolled in the kernel (k = 2048 of 8192 made a program the TPU compiler
crashed on)."""


class LowerError(Exception):
    """A region that does not fit its template after all; the caller retries with less fusion."""


SUBLANE = {4: 8, 2: 16, 1: 32}


@dataclass
class StepSchedule:
    """A grid whose logical axes are read from scalar-prefetched tables instead of walked densely.

    The pallas grid becomes `grid` (name, extent expression, semantics); each logical axis listed in
    `axis_code` is read, in the kernel and in every index map, from a table indexed by the new grid's step
    (`(kernel expression, index-map expression)`). Skipped blocks thus never become grid steps: no fetch,
    no compute, no per-step overhead.
    """

    prefetch: list[str]  # wrapper arrays passed as scalar prefetch (the kernel sees `<name>_ref`)
    grid: list[tuple[str, str, str]]  # (index name, wrapper extent expression, "parallel" | "arbitrary")
    axis_code: dict[int, tuple[str, str]]  # logical axis -> (kernel expr, index-map expr)
    wrapper_lines: list[str] = field(default_factory=list)  # wrapper code that builds the tables
    defs: list[str] = field(default_factory=list)  # module-level helpers the wrapper calls


@dataclass(eq=False)
class SpaceDim:
    key: str
    classes: list[Node]
    role: str  # grid | tiled | seq | full
    param: str | None = None
    axis: int | None = None
    lane_use: bool = False
    sublane_use: bool = False
    min_itemsize: int = 4

    @property
    def ext(self) -> str:
        return f"n_{self.key}"

    @property
    def blk(self) -> str:
        if self.role in ("tiled", "seq"):
            return f"b{self.key}"
        return self.ext

    @property
    def padded(self) -> str:
        return f"{self.ext}_p" if self.role in ("tiled", "seq") else self.ext


@dataclass
class Space:
    """The tile dims values of one phase live on (in order); the grid dims are implicit."""

    key: str
    dims: list[SpaceDim]


@dataclass
class Scope:
    lines: list[str]
    indent: str
    cache: dict[tuple[Any, str], tuple[str, frozenset[str]]] = field(default_factory=dict)
    special: dict[Any, Callable[[Scope, Space], tuple[str, frozenset[str]]]] = field(default_factory=dict)

    def add(self, line: str) -> None:
        self.lines.append(self.indent + line)


@dataclass
class Layout:
    """What every emitter of one kernel shares: grid axes, operand/output views and tile params."""

    grid_axes: list[int]
    axis_dims: dict[int, SpaceDim]
    index_args: str
    in_vars: list[Any]
    out_view: list[SpaceDim]
    params: list[ParamSpec]
    names_in: list[str]
    out_names: list[str]


class KernelBuilder:
    """The public base of every kernel family's builder (see `families.FAMILIES`).

    A builder turns one region into a `KernelSpec` (index maps, kernel body and wrapper as code, plus the
    figures the tuner needs) and the call expression `computation()` uses. Template families (a grouped
    matmul, a scan) subclass this directly; families re-emitted from the region's equations on a space of
    tile dims subclass `Builder`.
    """

    family = "kernel"

    def __init__(self, low: Lowering, region: Region, index: int, n_kernels: int) -> None:
        self.low = low
        self.g = low.g
        self.part = low.part
        self.region = region
        self.index = index
        self.stem = f"_{self.family}_{index}" if n_kernels > 1 else f"_{self.family}"
        self.cprefix = f"K{index}_" if n_kernels > 1 else ""
        self.inputs: list[Any] = self.part.region_inputs(region)
        self.outputs: list[Any] = self.part.region_outputs(region)

    def build(self) -> tuple[KernelSpec, str]:
        """The kernel spec and the call expression for computation()."""
        raise NotImplementedError


class Builder(KernelBuilder):
    """Kernels re-emitted from the region's equations; subclasses choose the space, the phases and the
    accumulation."""

    def __init__(self, low: Lowering, region: Region, index: int, n_kernels: int) -> None:
        super().__init__(low, region, index, n_kernels)
        self.ax = region.axes
        self.input_set = set(self.inputs)
        self.dims: list[SpaceDim] = []
        self.param_align: dict[str, int] = {}  # block param -> its alignment, once the layout is known
        self.input_view: dict[Any, list[SpaceDim]] = {}
        self.kernel_kw: dict[str, str] = {}  # kernel kwarg -> wrapper expression
        self.call_kw: dict[str, str] = {}  # wrapper kwarg -> computation() expression
        self.axis_used: set[int] = set()
        self.counter = 0
        self.notes: list[str] = []
        self.transcendentals = 0.0
        self.schedule: StepSchedule | None = None  # set by a subclass that walks a data-driven grid
        # grid dims held whole in every block that spans them and walked inside the kernel (grid extent 1):
        # the heads of a paged K/V page, fetched once for all of them (see paged.py)
        self.whole_grid: set[str] = set()

    # --- heads merged into the lanes ----------------------------------------------------------------
    merge_head_lanes = False
    """May an operand keep its own layout when only a grid dim sits out of the view's order, just before a
    whole last dim of 128-multiples (`lane_merge`)? A family opts in."""

    def lane_merge(self, var: Any, view: list[SpaceDim]) -> int | None:
        """The view position of a grid dim G when `var`'s array order is the view's order with G moved to
        just before the last dim L, L whole in every block (a head dim) with an extent a multiple of 128 in
        every traced configuration, and G walked one index per step (a head): the wrapper then merges
        (G, L) into the lanes (a free reshape of [B, S, H, D] to [B, S, H * D]) and the block's lane index is
        G's grid index, where the view order would transpose the array in HBM ([B, H, S, D]). The kernel
        sees the same block either way (G is squeezed)."""
        if not self.merge_head_lanes or dtype_name(var.aval) == "bool":
            return None
        classes = self.ax.classes(var)
        present = [c for c in classes if c is not None]
        spanned = [d for d in view if self.spans(var, d)]
        if len(present) < 3 or len(set(present)) != len(present) or len(spanned) != len(present):
            return None
        if any(len(d.classes) != 1 for d in spanned) or any(
            d.role != "grid" and not self.spans(var, d) for d in view
        ):
            return None
        in_view = [d.classes[0] for d in spanned]
        if in_view == present:
            return None  # already in view order
        last, g_cls = spanned[-1], present[-2]
        if last.role != "full" or present[-1] != last.classes[0]:
            return None
        if any(int(e) % 128 for e in self.ax.extents_all(last.classes[0])):
            return None
        g = next(d for d in spanned if d.classes[0] == g_cls)
        if g.role != "grid" or g.key in self.whole_grid or g.axis is None:
            return None
        if [c for c in in_view if c != g_cls] != [*present[:-2], present[-1]]:
            return None
        return view.index(g)

    def merged_dims(self, var: Any, view: list[SpaceDim]) -> tuple[list[SpaceDim], SpaceDim]:
        """For a lane-merged operand: its dims in array order less G (the lane dim last), and G."""
        g = view[self.lane_merge(var, view)]  # type: ignore[index]
        order = [c for c in self.ax.classes(var) if c is not None]
        dims = [next(d for d in view if d.classes and d.classes[0] == c) for c in order]
        return [d for d in dims if d is not g], g

    def map_entry(self, d: SpaceDim, var: Any) -> str:
        """One index-map entry: the block index along `d` (0 where the block is whole or `var` is flat)."""
        sched = self.schedule
        if d.axis is not None and d.role != "full" and self.spans(var, d):
            if sched is not None and d.axis in sched.axis_code:
                return sched.axis_code[d.axis][1]
            return f"{self.axis_name(d.axis)}_index"
        return "0"

    def merged_map(self, var: Any, view: list[SpaceDim], fname: str, index_args: str) -> str:
        dims, g = self.merged_dims(var, view)
        entries = [self.map_entry(d, var) for d in dims[:-1]] + [self.map_entry(g, var)]
        return f"def {fname}({index_args}):\n    return ({', '.join(entries)},)\n"

    def merged_block(self, var: Any, view: list[SpaceDim]) -> str:
        dims, _ = self.merged_dims(var, view)
        ents = []
        for d in dims:
            if d.role == "grid":
                ents.append(d.ext if d.key in self.whole_grid else "None")
            else:
                ents.append(d.blk)
        return f"({', '.join(ents)},)"

    def merged_shape(self, var: Any, view: list[SpaceDim], padded: bool) -> list[str]:
        """The lane-merged array's shape: each dim's extent (padded where the block needs it), and
        G x L last."""
        dims, g = self.merged_dims(var, view)
        shape = []
        for d in dims[:-1]:
            pad = padded and d.role in ("tiled", "seq") and not self.overhang_ok(d)
            shape.append(d.padded if pad else d.ext)
        shape.append(f"{g.ext} * {dims[-1].ext}")
        return shape

    # --- naming ---------------------------------------------------------------------------------------
    def local(self, var: Any) -> str:
        return self.low.name_of(var)

    def fresh(self, stem: str) -> str:
        self.counter += 1
        return f"{stem}{self.counter}"

    def class_dim(self, c: Node) -> SpaceDim:
        for d in self.dims:
            if c in d.classes:
                return d
        raise LowerError("a value varies along an axis the kernel does not iterate over")

    def class_var(self, c: Node) -> str:
        """Wrapper variable holding one class's extent."""
        d = self.class_dim(c)
        if len(d.classes) == 1:
            return d.ext
        return f"{d.ext}{d.classes.index(c)}"

    def group_extent(self, d: SpaceDim) -> int:
        return math.prod(self.ax.extent(c) for c in d.classes) if d.classes else 1

    def extent_lines(self, in_vars: list[Any]) -> list[str]:
        """Read every class extent off an input's shape; extents no input has come from computation()."""
        lines = []
        for d in self.dims:
            for c in d.classes:
                name = self.class_var(c)
                src = None
                for v in in_vars:
                    for k, vc in enumerate(self.ax.classes(v)):
                        if vc == c:
                            src = f"{self.local(v)}.shape[{k}]"
                            break
                    if src:
                        break
                if src is None:
                    expr = self.low.resolve_extent(self.ax.extents_all(c))
                    self.call_kw[name] = expr
                else:
                    lines.append(f"{name} = {src}")
        return lines

    def grid_dims(self) -> list[SpaceDim]:
        return [d for d in self.dims if d.role == "grid"]

    def spans(self, var: Any, d: SpaceDim) -> bool:
        fp = self.ax.footprint(var)
        return any(c in fp for c in d.classes)

    def check_in_space(self, var: Any, space: Space) -> None:
        allowed = {c for d in [*self.grid_dims(), *space.dims] for c in d.classes}
        if not self.ax.footprint(var) <= allowed:
            raise LowerError(f"a value is needed in a phase whose blocks do not cover its axes ({space.key})")

    def shape_of(self, space: Space, mat: frozenset[str]) -> list[str]:
        return [d.blk if d.key in mat else "1" for d in space.dims]

    def comment(self, var_dtype: str, space: Space, mat: frozenset[str], scalar: bool = False) -> str:
        return "  # " + shape_comment(var_dtype, [] if scalar else self.shape_of(space, mat))

    def kw(self, name: str, wrapper_expr: str) -> str:
        self.kernel_kw[name] = wrapper_expr
        return name

    def program_id(self, axis: int) -> str:
        self.axis_used.add(axis)
        return f"{self.axis_name(axis)}_index"

    def axis_name(self, axis: int) -> str:
        for d in self.dims:
            if d.axis == axis:
                return d.key
        raise AssertionError(axis)

    # --- literals -------------------------------------------------------------------------------------
    def literal_at(self, eqn_index: int, k: int) -> str:
        e = self.g.eqns[eqn_index]
        lit = e.invars[k]
        dtype = dtype_name(lit.aval)
        values = [a.invars[k].val for a in self.low.traces.aligned_eqns(e)]
        found = self.low.resolve_scalar(values, dtype, self.extent_atoms())
        if found is None:
            return literal_code(values[0], dtype)
        expr, scope = found
        name = self.low.scalar_name(expr)
        if scope == "local":
            if name not in self.kernel_kw:
                self.kernel_kw[name] = expr
            return name
        self.call_kw[name] = expr
        return self.kw(name, name)

    def extent_atoms(self) -> list[Atom]:
        """The wrapper's extents (per class and per merged dim), as atoms for literal resolution."""
        atoms: list[Atom] = []
        seen: set[tuple[float, ...]] = set()
        for d in self.dims:
            for c in d.classes:
                vals = tuple(float(x) for x in self.ax.extents_all(c))
                if vals not in seen and any(x != 1 for x in vals):
                    seen.add(vals)
                    atoms.append(Atom(self.class_var(c), vals, True))
            if len(d.classes) > 1:
                per = [self.ax.extents_all(c) for c in d.classes]
                vals = tuple(float(math.prod(col)) for col in zip(*per, strict=True))
                if vals not in seen:
                    seen.add(vals)
                    atoms.append(Atom(d.ext, vals, True))
        return atoms

    # --- emission -------------------------------------------------------------------------------------
    def value(self, var: Any, space: Space, scope: Scope) -> tuple[str, frozenset[str]]:
        if is_literal(var):
            raise AssertionError("literals are handled by literal_at")
        key = (var, space.key)
        if key in scope.cache:
            return scope.cache[key]
        if var in scope.special:
            res = scope.special[var](scope, space)
        elif var in self.input_set:
            res = self.load(var, space, scope)
        else:
            p = self.g.producer.get(var)
            if p is None or p not in set(self.region.eqns()):
                raise LowerError("a value the kernel needs is computed outside it")
            res = self.emit_eqn(p, var, space, scope)
        scope.cache[key] = res
        return res

    def load(self, var: Any, space: Space, scope: Scope) -> tuple[str, frozenset[str]]:
        self.check_in_space(var, space)
        view = [*self.grid_dims(), *space.dims]
        prev = self.input_view.get(var)
        if prev is not None and self._layout(var, prev) != self._layout(var, view):
            raise LowerError("an input is read in two different layouts")
        if prev is None:  # the first view keeps the key: another differs only where the block is 1 wide
            self.input_view[var] = view
        mat = frozenset(d.key for d in space.dims if self.spans(var, d))
        name = self.fresh(f"{self.local(var)}_blk")
        dt = dtype_name(var.aval)
        code = f"{self.local(var)}_ref[...]"
        if dt == "bool":
            code += " != 0"
        scope.add(f"{name} = {code}" + self.comment(dt, space, mat))
        for d in space.dims:
            if d.key in mat:
                if d is space.dims[-1]:
                    d.lane_use = True
                elif len(space.dims) >= 2 and d is space.dims[-2]:
                    d.sublane_use = True
                d.min_itemsize = min(d.min_itemsize, 4 if dt == "bool" else var.aval.dtype.itemsize)
        return name, mat

    def _layout(self, var: Any, view: list[SpaceDim]) -> list[str | None]:
        """The block an input is read as: a dim it does not span is 1 wide whatever the space calls it
        (a sequence's scalar bound read by the score step and by the epilogue)."""
        return [d.key if self.spans(var, d) else None for d in view]

    def materialise(
        self, code: str, mat: frozenset[str], need: set[str], space: Space, scope: Scope, dtype: str
    ) -> tuple[str, frozenset[str]]:
        if need <= mat:
            return code, mat
        full = frozenset(mat | need)
        shape = ", ".join(self.shape_of(space, full))
        for d in space.dims:
            if d.key in full:
                self.kw(d.blk, d.blk)
        name = self.fresh("bcast")
        scope.add(f"{name} = jnp.broadcast_to({code}, ({shape},))" + self.comment(dtype, space, full))
        return name, full

    def emit_eqn(self, p: int, var: Any, space: Space, scope: Scope) -> tuple[str, frozenset[str]]:
        e = self.g.eqns[p]
        name = e.primitive.name
        kind = self.g.kind[p]
        out = e.outvars[0]
        self.check_in_space(out, space)
        dt = dtype_name(out.aval)
        scalar = len(out.aval.shape) == 0
        if kind == "absorbed" and name == "iota":
            return self.emit_iota(e, space, scope)
        if kind == "absorbed" and name != "convert_element_type":
            return (
                self.value(e.invars[0], space, scope)
                if not is_literal(e.invars[0])
                else (
                    self.literal_at(p, 0),
                    frozenset(),
                )
            )
        if kind in ("elementwise", "absorbed"):
            args: list[str] = []
            mats: set[str] = set()
            bool_mats: dict[int, frozenset[str] | None] = {}
            in_dtypes: list[str] = []
            for k, v in enumerate(e.invars):
                if is_literal(v) and name.startswith("shift_"):
                    # lax shifts take no weak-typed Python ints (a count may resolve to a static argument)
                    args.append(f"{dtype_code(dtype_name(v.aval))}({self.literal_at(p, k)})")
                elif is_literal(v):
                    args.append(self.literal_at(p, k))
                else:
                    c, m = self.value(v, space, scope)
                    args.append(c)
                    mats |= m
                    bool_mats[k] = m if dtype_name(v.aval) == "bool" else None
                in_dtypes.append(dtype_name(v.aval))
            pred = bool_mats.get(0)
            narrow_select = name == "select_n" and dt in ("bfloat16", "float16") and pred not in (None, mats)
            if narrow_select:
                # a mask broadcast along 16-bit values: Mosaic cannot relayout that i1 vector for a 16-bit
                # select ("Non-singleton logical dimension is replicated in destination but not in source"),
                # so the mask is broadcast as int32 and compared back, and the select runs in float32
                wide, _ = self.materialise(
                    f"{args[0]}.astype(jnp.int32)", pred, set(mats), space, scope, "int32"
                )
                args = [f"({wide} != 0)", *(f"jnp.asarray({a}, jnp.float32)" for a in args[1:])]
            try:
                expr = elementwise_expr(e, args, dt, in_dtypes, scalar and not mats)
                if narrow_select:
                    expr = f"({expr}).astype({dtype_code(dt)})"
            except EmitError as exc:
                raise LowerError(str(exc)) from exc
            if name in (
                "exp",
                "log",
                "tanh",
                "logistic",
                "erf",
                "sin",
                "cos",
                "pow",
                "exp2",
                "log1p",
                "rsqrt",
                "sqrt",
            ):
                self.transcendentals += 1
            mat = frozenset(mats)
            nm = self.fresh(stem_of(name))
            scope.add(f"{nm} = {expr}" + self.comment(dt, space, mat, scalar and not mats))
            return nm, mat
        if kind == "reduce" and name == "top_k":
            return self.emit_topk(p, var, space, scope)
        if kind == "reduce":
            return self.emit_reduce(p, space, scope)
        raise LowerError(f"{name} cannot run inside this kernel")

    def emit_topk(self, p: int, var: Any, space: Space, scope: Scope) -> tuple[str, frozenset[str]]:
        """`lax.top_k` along a whole axis: k rounds of (max, first index of the max, knock it out)."""
        e = self.g.eqns[p]
        x = e.invars[0]
        (axis,) = reduced_axes(e)
        c_in = self.ax.cls(x, axis)
        c_out = self.ax.cls(e.outvars[0], axis)
        if c_in is None or c_out is None:
            raise LowerError("top_k along a size-1 axis")
        d_in, d_out = self.class_dim(c_in), self.class_dim(c_out)
        if d_in not in space.dims or d_out not in space.dims or d_in.role != "full" or d_out.role != "full":
            raise LowerError("top_k along an axis split across grid steps")
        if len(d_in.classes) != 1 or len(d_out.classes) != 1 or not is_float(dtype_name(x.aval)):
            raise LowerError("top_k over a merged axis or of integers")
        k_max = max(int(shape[axis]) for shape in self.g.traces.shapes(e.outvars[0]))
        if k_max > TOPK_MAX_K:
            raise LowerError(
                f"top_k of {k_max} (the kernel selects by k rounds of max over the row; beyond {TOPK_MAX_K} "
                "that is a sort, which the offline author has no kernel for)"
            )
        code, mat = self.value(x, space, scope)
        need = {d.key for d in space.dims if self.spans(x, d)}
        code, mat = self.materialise(code, mat, need, space, scope, dtype_name(x.aval))
        pi, po = space.dims.index(d_in), space.dims.index(d_out)
        n_in = self.kw(d_in.ext, d_in.ext)
        n_k = self.kw(d_out.ext, d_out.ext)
        shape_in = ["1"] * len(space.dims)
        shape_in[pi] = n_in
        shape_k = ["1"] * len(space.dims)
        shape_k[po] = n_k
        vals, idxs, work = self.fresh("topk_vals"), self.fresh("topk_idx"), self.fresh("topk_work")
        scope.add(f"{work} = {code}.astype(jnp.float32)  # top_k: k rounds of max / first argmax / knock-out")
        scope.add(
            f"in_pos = lax.broadcasted_iota(jnp.int32, ({', '.join(shape_in)},), {pi}).astype(jnp.float32)"
        )
        if po < len(space.dims) - 2:
            # k on a leading dim: each round's winners are whole (rows, lanes) slabs, stacked at the end;
            # writing them into a k-long accumulator with a select would touch all k slabs every round
            scope.add(f"{vals}, {idxs} = [], []")
            scope.add(f"for j in range({n_k}):")
            scope.add(f"    best = jnp.max({work}, axis={pi}, keepdims=True)")
            scope.add(
                f"    first = jnp.min(jnp.where({work} == best, in_pos, float({n_in})), axis={pi}, keepdims=True)"
            )
            scope.add(f"    {vals}.append(best)")
            scope.add(f"    {idxs}.append(first.astype(jnp.int32))")
            scope.add(f"    {work} = jnp.where(in_pos == first, -jnp.inf, {work})")
            scope.add(f"{vals} = jnp.concatenate({vals}, axis={po})")
            scope.add(f"{idxs} = jnp.concatenate({idxs}, axis={po})")
        else:
            scope.add(f"k_pos = lax.broadcasted_iota(jnp.int32, ({', '.join(shape_k)},), {po})")
            scope.add(f"row_shape = jnp.max({work}, axis={pi}, keepdims=True).shape")
            scope.add(f"{vals} = jnp.zeros(jnp.broadcast_shapes(row_shape, k_pos.shape), jnp.float32)")
            scope.add(f"{idxs} = jnp.zeros(jnp.broadcast_shapes(row_shape, k_pos.shape), jnp.int32)")
            scope.add(f"for j in range({n_k}):")
            scope.add(f"    best = jnp.max({work}, axis={pi}, keepdims=True)")
            scope.add(
                f"    first = jnp.min(jnp.where({work} == best, in_pos, float({n_in})), axis={pi}, keepdims=True)"
            )
            scope.add(f"    {vals} = jnp.where(k_pos == j, best, {vals})")
            scope.add(f"    {idxs} = jnp.where(k_pos == j, first.astype(jnp.int32), {idxs})")
            scope.add(f"    {work} = jnp.where(in_pos == first, -jnp.inf, {work})")
        out_mat = frozenset((mat - {d_in.key}) | {d_out.key})
        vdt = dtype_name(e.outvars[0].aval)
        vcode = vals if vdt == "float32" else f"{vals}.astype({dtype_code(vdt)})"
        idt = dtype_name(e.outvars[1].aval)
        icode = idxs if idt == "int32" else f"{idxs}.astype({dtype_code(idt)})"
        scope.cache[(e.outvars[0], space.key)] = (vcode, out_mat)
        scope.cache[(e.outvars[1], space.key)] = (icode, out_mat)
        return scope.cache[(var, space.key)]

    def emit_reduce(self, p: int, space: Space, scope: Scope) -> tuple[str, frozenset[str]]:
        e = self.g.eqns[p]
        x = e.invars[0]
        code, mat = self.value(x, space, scope)
        red_classes = {self.ax.cls(x, a) for a in reduced_axes(e)} - {None}
        red_dims = []
        for c in red_classes:
            d = self.class_dim(c)
            if d not in space.dims or d.role != "full":
                raise LowerError("a reduction along an axis that is split across grid steps")
            if not set(d.classes) <= red_classes:
                raise LowerError("a reduction over part of a merged axis")
            if d not in red_dims:
                red_dims.append(d)
        need = {d.key for d in red_dims}
        dt_in = dtype_name(x.aval)
        code, mat = self.materialise(code, mat, need, space, scope, dt_in)
        pos = tuple(sorted(space.dims.index(d) for d in red_dims))
        out = e.outvars[0]
        dt = dtype_name(out.aval)
        name = e.primitive.name
        axis = f"({', '.join(map(str, pos))},)" if len(pos) != 1 else str(pos[0])
        if not pos:  # reducing only size-1 dims: nothing to do
            return code, mat
        if name in ("reduce_sum", "reduce_max", "reduce_min", "reduce_and", "reduce_or"):
            fn = {
                "reduce_sum": "jnp.sum",
                "reduce_max": "jnp.max",
                "reduce_min": "jnp.min",
                "reduce_and": "jnp.all",
                "reduce_or": "jnp.any",
            }[name]
            expr = f"{fn}({code}, axis={axis}, keepdims=True)"
        elif name in ("argmax", "argmin"):
            if len(pos) != 1:
                raise LowerError("argmax over several axes")
            src = code if dt_in == "float32" else f"{code}.astype(jnp.float32)"
            fn = "jnp.argmax" if name == "argmax" else "jnp.argmin"
            expr = f"{fn}({src}, axis={pos[0]}, keepdims=True).astype({dtype_code(dt)})"
        else:
            raise LowerError(f"no kernel code for {name}")
        newmat = frozenset(mat - need)
        nm = self.fresh(stem_of(name))
        scope.add(f"{nm} = {expr}" + self.comment(dt, space, newmat))
        return nm, newmat

    def emit_iota(self, e: Any, space: Space, scope: Scope) -> tuple[str, frozenset[str]]:
        out = e.outvars[0]
        dim = e.params["dimension"]
        dt = dtype_name(out.aval)
        c = self.ax.cls(out, dim)
        if c is None:
            nm = self.fresh("iota")
            scope.add(f"{nm} = {literal_code(0, dt)}  # a size-1 iota")
            return nm, frozenset()
        d = self.class_dim(c)
        if d.role == "grid":
            idx = self.program_id(d.axis)  # type: ignore[arg-type]
            flat = idx
            mat: frozenset[str] = frozenset()
        else:
            if d not in space.dims:
                raise LowerError("an iota along an axis outside this phase")
            pos = space.dims.index(d)
            shape = ["1"] * len(space.dims)
            shape[pos] = d.blk
            self.kw(d.blk, d.blk)
            # positions along a block dim live on its lanes / sublanes like a loaded operand's elements: its
            # block is tuned to their tile even when no operand spans it (a one-hot compare against labels)
            if pos == len(space.dims) - 1:
                d.lane_use = True
            elif pos == len(space.dims) - 2:
                d.sublane_use = True
            flat = f"lax.broadcasted_iota(jnp.int32, ({', '.join(shape)},), {pos})"
            if d.role in ("tiled", "seq"):
                flat = f"{self.program_id(d.axis)} * {d.blk} + {flat}"  # type: ignore[arg-type]
            mat = frozenset({d.key})
        if len(d.classes) > 1:
            i = d.classes.index(c)
            inner = [self.kw(self.class_var(k), self.class_var(k)) for k in d.classes[i + 1 :]]
            expr = f"({flat})"
            if inner:
                expr = f"lax.div({expr}, {' * '.join(inner)})"
            if i > 0:
                expr = f"lax.rem({expr}, {self.kw(self.class_var(c), self.class_var(c))})"
            flat = expr
        nm = self.fresh("iota")
        if dt != "int32":
            flat = f"({flat}).astype({dtype_code(dt)})"
        scope.add(f"{nm} = {flat}" + self.comment(dt, space, mat, not mat))
        return nm, mat

    def store(self, var: Any, ref: str, space: Space, scope: Scope) -> None:
        code, mat = self.value(var, space, scope)
        need = {d.key for d in space.dims if self.spans(var, d)}
        dt = dtype_name(var.aval)
        code, mat = self.materialise(code, mat, need, space, scope, dt)
        scope.add(
            f"{ref}[...] = {code}.astype({ref}.dtype)"
            if code.isidentifier()
            else f"{ref}[...] = ({code}).astype({ref}.dtype)"
        )

    # --- layouts --------------------------------------------------------------------------------------
    def view_classes(self, view: list[SpaceDim]) -> list[Node]:
        return [c for d in view for c in d.classes]

    def kernel_output(self, var: Any) -> bool:
        """Is `var` written by another kernel of the program? Its transpose into this kernel's view then
        goes through `lax.optimization_barrier`: free on a TPU (a Pallas call's result has a fixed
        row-major layout, nothing for XLA to fold the transpose into), but on a CPU, where the harness
        runs kernels inlined by Pallas's plain interpreter, XLA otherwise folds the transpose into the
        layout of the producer's dot, and XLA:CPU has no bf16 x bf16 -> f32 dot for that layout
        (`Unsupported element type for DotThunk::Execute`, top-k gating's transposed router logits)."""
        p = self.g.producer.get(var)
        return p is not None and self.low.part.status[p] == "owned"

    def to_view_code(self, var: Any, view: list[SpaceDim], name: str) -> list[str]:
        """Lines that turn the value `name` (laid out as the jaxpr var) into its canonical view array."""
        lines: list[str] = []
        classes = self.ax.classes(var)
        nonunit = [i for i, c in enumerate(classes) if c is not None]
        allowed = self.view_classes(view)
        order = [c for c in allowed]
        for i in nonunit:
            if classes[i] not in order:
                raise LowerError("an operand varies along an axis its view does not have")
        cur = name
        dt = dtype_name(var.aval)
        if dt == "bool":
            lines.append(f"{cur} = {cur}.astype(jnp.int32)")
        # 1. drop size-1 dims
        if len(nonunit) != len(classes):
            shape = ", ".join(f"{cur}.shape[{i}]" for i in nonunit)
            lines.append(f"{cur} = {cur}.reshape({shape}{',' if len(nonunit) == 1 else ''})")
        # 2. transpose into view order
        present = [classes[i] for i in nonunit]
        perm = sorted(range(len(present)), key=lambda j: order.index(present[j]))
        if perm != list(range(len(present))):
            src = f"lax.optimization_barrier({cur})" if self.kernel_output(var) else cur
            lines.append(f"{cur} = jnp.transpose({src}, {int_tuple(perm)})")
        present = [present[j] for j in perm]
        # 3. per-class shape with 1s for absent classes, broadcast partially spanned dims, merge
        expanded = []
        full = []
        need_bcast = False
        for d in view:
            spanned = [c in present for c in d.classes]
            for c, s in zip(d.classes, spanned, strict=True):
                expanded.append(self.class_var(c) if s else "1")
                if any(spanned):
                    full.append(self.class_var(c))
                    if not s:
                        need_bcast = True
                else:
                    full.append("1")
        merged = []
        for d in view:
            if not d.classes:
                merged.append("1")
                continue
            spanned_any = any(c in present for c in d.classes)
            merged.append(d.ext if spanned_any else "1")
        if need_bcast:
            lines.append(f"{cur} = jnp.broadcast_to({cur}.reshape({_tuple(expanded)}), {_tuple(full)})")
        if len(merged) != len(present) or need_bcast or any(len(d.classes) > 1 for d in view):
            lines.append(f"{cur} = {cur}.reshape({_tuple(merged)})")
        return lines

    def from_view_code(self, var: Any, view: list[SpaceDim], name: str) -> list[str]:
        """Lines that turn a cropped output array (in its view) back into the jaxpr var's layout."""
        lines: list[str] = []
        classes = self.ax.classes(var)
        present = [c for c in classes if c is not None]
        cur = name
        per_class = []
        index = []
        keep_classes = []
        for d in view:
            spanned_any = any(c in present for c in d.classes)
            if not d.classes:
                per_class.append("1")
                index.append("0")
                continue
            for c in d.classes:
                if spanned_any:
                    per_class.append(self.class_var(c))
                    if c in present:
                        index.append(":")
                        keep_classes.append(c)
                    else:
                        index.append("0")
                else:
                    per_class.append("1")
                    index.append("0")
        merged = []
        for d in view:
            spanned_any = any(c in present for c in d.classes)
            merged.append(d.ext if (d.classes and spanned_any) else "1")
        if per_class != merged:
            lines.append(f"{cur} = {cur}.reshape({_tuple(per_class)})")
        cur_shape = per_class
        if any(i != ":" for i in index):
            lines.append(f"{cur} = {cur}[{', '.join(index)}]")
            cur_shape = [s for s, i in zip(per_class, index, strict=True) if i == ":"]
        perm = [keep_classes.index(c) for c in present]
        if perm != list(range(len(perm))):
            lines.append(f"{cur} = jnp.transpose({cur}, {int_tuple(perm)})")
            cur_shape = [cur_shape[j] for j in perm]
        shape = [self.class_var(c) if c is not None else "1" for c in classes]
        if shape != cur_shape:
            lines.append(f"{cur} = {cur}.reshape({_tuple(shape)})")
        if dtype_name(var.aval) == "bool":
            lines.append(f"{cur} = {cur} != 0")
        return lines

    # --- the wrapper ----------------------------------------------------------------------------------
    def build(self) -> tuple[KernelSpec, str]:
        """Returns the kernel spec and the call expression for computation()."""
        self.make_space()
        body = self.make_body()
        return self.assemble(body)

    def make_space(self) -> None:
        raise NotImplementedError

    def make_body(self) -> list[str]:
        raise NotImplementedError

    def scratch(self) -> list[tuple[str, str, list[SpaceDim | str]]]:
        """(ref name, dtype code, block dims) of VMEM scratch buffers."""
        return []

    def out_space(self) -> Space:
        raise NotImplementedError

    def title(self) -> str:
        return self.family

    def assemble(self, body: list[str]) -> tuple[KernelSpec, str]:
        """The kernel's code and spec around its body. Each piece has its own emitter on one shared
        `Layout` (grid axes, operand views, tile params), so a family can override one of them."""
        lay = self.layout()
        maps, map_of = self.emit_index_maps(lay)
        kernel = self.emit_kernel_function(lay, body)
        wrapper = self.emit_wrapper(lay, map_of)
        spec = self.kernel_spec(lay, "\n\n".join([*maps, kernel, wrapper]))
        return spec, self.call_expression(lay)

    def layout(self) -> Layout:
        """Grid axes, operand and output views, and the tile params with their alignment."""
        grid_axes = sorted({d.axis for d in self.dims if d.axis is not None})
        axis_dims = {a: next(d for d in self.dims if d.axis == a) for a in grid_axes}
        sched = self.schedule
        index_args = ", ".join(f"{axis_dims[a].key}_index" for a in grid_axes)
        if sched is not None:
            index_args = ", ".join(
                [f"{n}_index" for n, _, _ in sched.grid] + [f"{n}_ref" for n in sched.prefetch]
            )
        in_vars = [v for v in self.inputs if v in self.input_view]
        unused = [v for v in self.inputs if v not in self.input_view]
        if unused:
            raise LowerError("an input of the region was never read")
        out_space = self.out_space()
        out_view = [*self.grid_dims(), *out_space.dims]
        for v in self.outputs:
            if not self.ax.footprint(v) <= set(self.view_classes(out_view)):
                raise LowerError("an output varies along an axis the kernel's output blocks do not have")
        tile_out = out_space.dims
        for v in self.outputs:
            isz = 4 if dtype_name(v.aval) == "bool" else v.aval.dtype.itemsize
            for j, d in enumerate(tile_out):
                if not self.spans(v, d):
                    continue
                if j == len(tile_out) - 1:
                    d.lane_use = True
                elif j == len(tile_out) - 2:
                    d.sublane_use = True
                d.min_itemsize = min(d.min_itemsize, isz)
        params: list[ParamSpec] = []
        for d in self.dims:
            if d.role in ("tiled", "seq") and d.param and not any(p.name == d.param for p in params):
                if d.lane_use:
                    role, align = "lane", 128
                elif d.sublane_use:
                    role, align = "sublane", SUBLANE.get(d.min_itemsize, 8)
                else:
                    role, align = "leading", 1
                params.append(
                    ParamSpec(
                        name=d.param,
                        role=role,  # type: ignore[arg-type]
                        align=align,
                        extent=self.group_extent(d),
                        default=0,
                        doc=self.param_doc(d),
                    )
                )
        self.param_align = {p.name: p.align for p in params}
        names_in = [self.local(v) for v in in_vars]
        out_names = ["out"] if len(self.outputs) == 1 else [f"out{i}" for i in range(len(self.outputs))]
        return Layout(
            grid_axes=grid_axes,
            axis_dims=axis_dims,
            index_args=index_args,
            in_vars=in_vars,
            out_view=out_view,
            params=params,
            names_in=names_in,
            out_names=out_names,
        )

    def emit_index_maps(self, lay: Layout) -> tuple[list[str], dict[str, str]]:
        """Named index maps, one per distinct operand view (identical maps are shared)."""
        in_vars, out_view, names_in, out_names = lay.in_vars, lay.out_view, lay.names_in, lay.out_names
        index_args = lay.index_args
        # index maps
        code: list[str] = []

        def index_map(view: list[SpaceDim], var: Any, fname: str) -> str:
            if self.lane_merge(var, view) is not None:
                return self.merged_map(var, view, fname, index_args)
            entries = [self.map_entry(d, var) for d in view]
            return f"def {fname}({index_args}):\n    return ({', '.join(entries)}{',' if len(entries) == 1 else ''})\n"

        seen_maps: dict[str, str] = {}
        map_of: dict[str, str] = {}
        for v, nm in zip(in_vars, names_in, strict=True):
            text = index_map(self.input_view[v], v, "FNAME")
            if text in seen_maps:
                map_of[nm] = seen_maps[text]
            else:
                fname = f"{self.stem}_{nm}_index_map"
                seen_maps[text] = fname
                map_of[nm] = fname
                code.append(text.replace("FNAME", fname))
        for v, nm in zip(self.outputs, out_names, strict=True):
            text = index_map(out_view, v, "FNAME")
            if text in seen_maps:
                map_of[nm] = seen_maps[text]
            else:
                fname = f"{self.stem}_{nm}_index_map"
                seen_maps[text] = fname
                map_of[nm] = fname
                code.append(text.replace("FNAME", fname))
        return code, map_of

    def emit_kernel_function(self, lay: Layout, body: list[str]) -> str:
        """The kernel: refs, then keyword sizes, the grid indices it reads, and the body."""
        names_in, out_names = lay.names_in, lay.out_names
        sched = self.schedule
        refs = (
            [f"{n}_ref" for n in (sched.prefetch if sched is not None else [])]
            + [f"{n}_ref" for n in names_in]
            + [f"{n}_ref" for n in out_names]
            + [s[0] for s in self.scratch()]
        )
        kw = sorted(self.kernel_kw)
        sig = ", ".join(refs) + (", *, " + ", ".join(kw) if kw else "")
        doc = f'    """{self.kernel_doc()}"""'
        kernel = [f"def {self.stem}_kernel({sig}):", doc]
        for a in sorted(self.axis_used):
            if sched is not None and a in sched.axis_code:
                kernel.append(f"    {self.axis_name(a)}_index = {sched.axis_code[a][0]}")
            else:
                kernel.append(f"    {self.axis_name(a)}_index = pl.program_id({a})")
        kernel += body
        # module-level helpers a data-driven grid's tables need come just before the kernel
        return "\n\n".join([*(sched.defs if sched is not None else []), "\n".join(kernel) + "\n"])

    def emit_wrapper(self, lay: Layout, map_of: dict[str, str]) -> str:
        """The wrapper: extents from the inputs, block sizes, views and padding, the pallas_call, crops."""
        kw = sorted(self.kernel_kw)
        grid_axes, axis_dims, in_vars = lay.grid_axes, lay.axis_dims, lay.in_vars
        out_view, params, names_in, out_names = lay.out_view, lay.params, lay.names_in, lay.out_names
        sched = self.schedule
        # wrapper
        w: list[str] = []
        extent_lines = self.extent_lines(in_vars)
        wargs = ", ".join(self.wrapper_params(names_in))
        ckw = sorted(self.call_kw)
        wsig = wargs + (", *, " + ", ".join(ckw) if ckw else "")
        w.append(f"def {self.stem}({wsig}):")
        w.append(f'    """{self.wrapper_doc(in_vars)}"""')
        # class extents
        for line in extent_lines:
            w.append("    " + line)
        for d in self.dims:
            if len(d.classes) > 1:
                w.append(f"    {d.ext} = {' * '.join(self.class_var(c) for c in d.classes)}")
            elif not d.classes:
                w.append(f"    {d.ext} = 1")
        for d in self.dims:
            if d.role in ("tiled", "seq"):
                if d.param is None:
                    w.append(f"    {d.blk} = {d.ext}")
                elif d.key.startswith("k") and d is not next(x for x in self.dims if x.param == d.param):
                    first = next(x for x in self.dims if x.param == d.param)
                    w.append(f"    {d.blk} = {first.blk}")
                else:
                    p = next(pp for pp in params if pp.name == d.param)
                    w.append(f"    {d.blk} = _block({d.ext}, {d.param}, {p.align})")
                w.append(f"    {d.padded} = _round_up({d.ext}, {d.blk})")
        w.extend("    " + line for line in self.block_size_lines())
        # canonical inputs, padded
        for v, nm in zip(in_vars, names_in, strict=True):
            view = self.input_view[v]
            special = self.operand_lines(v, nm)
            if special is not None:
                w.extend("    " + line for line in special)
                continue
            if self.lane_merge(v, view) is not None:
                unpadded = self.merged_shape(v, view, padded=False)
                w.append(f"    {nm} = {nm}.reshape({', '.join(unpadded)})  # heads merged into the lanes")
                target = self.merged_shape(v, view, padded=True)
                if target != unpadded:
                    w.append(f"    {nm} = _pad_to({nm}, ({', '.join(target)},))")
                continue
            for line in self.to_view_code(v, view, nm):
                w.append("    " + line)
            target = [
                d.padded
                if (d.role in ("tiled", "seq") and self.spans(v, d) and not self.overhang_ok(d))
                else None
                for d in view
            ]
            if any(t is not None for t in target):
                shape = ", ".join(t if t is not None else f"{nm}.shape[{i}]" for i, t in enumerate(target))
                w.append(f"    {nm} = _pad_to({nm}, ({shape},))")
        grid = ", ".join(
            (
                f"{axis_dims[a].padded} // {axis_dims[a].blk}"
                if axis_dims[a].role in ("tiled", "seq")
                else "1"
                if axis_dims[a].key in self.whole_grid
                else axis_dims[a].ext
            )
            for a in grid_axes
        )

        def block(view: list[SpaceDim], var: Any) -> str:
            ents = []
            for d in view:
                if d.role == "grid" and d.key in self.whole_grid and self.spans(var, d):
                    ents.append(d.ext)
                elif d.role == "grid":
                    ents.append("None")
                elif not self.spans(var, d):
                    ents.append("1")
                else:
                    ents.append(d.blk)
            return f"({', '.join(ents)}{',' if len(ents) == 1 else ''})"

        def spec_block(view: list[SpaceDim], var: Any) -> str:
            return (
                self.merged_block(var, view) if self.lane_merge(var, view) is not None else block(view, var)
            )

        in_specs = [
            self.operand_spec(v, nm, map_of)
            or f"pl.BlockSpec({spec_block(self.input_view[v], v)}, {map_of[nm]})"
            for v, nm in zip(in_vars, names_in, strict=True)
        ]
        out_specs = []
        out_shapes = []
        for v, nm in zip(self.outputs, out_names, strict=True):
            out_specs.append(f"pl.BlockSpec({spec_block(out_view, v)}, {map_of[nm]})")
            if self.lane_merge(v, out_view) is not None:
                shape = self.merged_shape(v, out_view, padded=True)
            else:
                shape = [
                    ("1" if not self.spans(v, d) else d.ext if self.overhang_ok(d) else d.padded)
                    for d in out_view
                ]
            dt = dtype_name(v.aval)
            dt = "int32" if dt == "bool" else dt
            out_shapes.append(
                f"jax.ShapeDtypeStruct(({', '.join(shape)}{',' if len(shape) == 1 else ''}), {dtype_code(dt)})"
            )
        scratch = [
            f"pltpu.VMEM(({', '.join(d if isinstance(d, str) else d.blk for d in dims)},), {dt})"
            for _, dt, dims in self.scratch()
        ]
        sem = ", ".join('"arbitrary"' if axis_dims[a].role == "seq" else '"parallel"' for a in grid_axes)
        n_grid = len(grid_axes)
        if sched is not None:
            grid = ", ".join(ext for _, ext, _ in sched.grid)
            sem = ", ".join(f'"{s}"' for _, _, s in sched.grid)
            n_grid = len(sched.grid)
            w.extend("    " + line for line in sched.wrapper_lines)
        partial = self.stem + "_kernel"
        if kw:
            partial = (
                f"functools.partial({self.stem}_kernel, "
                + ", ".join(f"{k}={self.kernel_kw[k]}" for k in kw)
                + ")"
            )
        one = len(self.outputs) == 1
        if one:
            w.append(f"    out_shape = {out_shapes[0]}")
        else:
            w.append("    out_shape = [")
            for sh in out_shapes:
                w.append(f"        {sh},")
            w.append("    ]")
        w.append("    cost = pl.CostEstimate(")
        w.append(f"        flops={self.flops_code()},")
        w.append(f"        transcendentals={self.transcendentals_code()},")
        w.append(f"        bytes_accessed={self.bytes_code(names_in, one)},")
        w.append("    )")
        w.append("    outs = pl.pallas_call(" if not one else "    out = pl.pallas_call(")
        w.append(f"        {partial},")
        pad = "        "
        if sched is not None:
            w.append("        grid_spec=pltpu.PrefetchScalarGridSpec(")
            w.append(f"            num_scalar_prefetch={len(sched.prefetch)},")
            pad = "            "
        w.append(f"{pad}grid=({grid}{',' if n_grid == 1 else ''}),")
        w.append(f"{pad}in_specs=[")
        for sp in in_specs:
            w.append(f"{pad}    {sp},")
        w.append(f"{pad}],")
        if one:
            w.append(f"{pad}out_specs={out_specs[0]},")
        else:
            w.append(f"{pad}out_specs=[" + ", ".join(out_specs) + "],")
        if scratch:
            w.append(f"{pad}scratch_shapes=[{', '.join(scratch)}],")
        if sched is not None:
            w.append("        ),")
        w.append("        out_shape=out_shape,")
        w.append("        compiler_params=pltpu.CompilerParams(")
        w.append(f"            dimension_semantics=({sem}{',' if n_grid == 1 else ''}),")
        w.append(f"            vmem_limit_bytes={self.cprefix}VMEM_LIMIT_BYTES,")
        w.append("        ),")
        w.append("        cost_estimate=cost,")
        w.append(
            f"    )({', '.join([*(sched.prefetch if sched is not None else []), *self.call_args(names_in)])})"
        )
        results = []
        for i, (v, nm) in enumerate(zip(self.outputs, out_names, strict=True)):
            src = "out" if one else f"outs[{i}]"
            crop = [
                d.ext if self.spans(v, d) and d.role in ("tiled", "seq") and not self.overhang_ok(d) else None
                for d in out_view
            ]
            if one:
                cur = "out"
            else:
                cur = nm
                w.append(f"    {nm} = {src}")
            if self.lane_merge(v, out_view) is not None:
                whole = self.merged_shape(v, out_view, padded=False)
                if whole != self.merged_shape(v, out_view, padded=True):
                    w.append(f"    {cur} = _crop({cur}, ({', '.join(whole)},))")
                shape = [self.class_var(c) if c is not None else "1" for c in self.ax.classes(v)]
                w.append(f"    {cur} = {cur}.reshape({_tuple(shape)})  # the heads out of the lanes")
                results.append(cur)
                continue
            if any(c is not None for c in crop):
                shape = ", ".join(c if c is not None else f"{cur}.shape[{j}]" for j, c in enumerate(crop))
                w.append(f"    {cur} = _crop({cur}, ({shape},))")
            for line in self.from_view_code(v, out_view, cur):
                w.append("    " + line)
            results.append(cur)
        w.append(f"    return {', '.join(results)}")
        return "\n".join(w) + "\n"

    def wrapper_params(self, names_in: list[str]) -> list[str]:
        """The wrapper's positional parameters (one per region input unless a family reads one otherwise)."""
        return names_in

    def block_size_lines(self) -> list[str]:
        """Wrapper lines after the block sizes (a family that adjusts one of them)."""
        return []

    def operand_lines(self, var: Any, name: str) -> list[str] | None:
        """Wrapper lines that prepare an operand its own way, or None for the canonical view and padding."""
        return None

    def operand_spec(self, var: Any, name: str, map_of: dict[str, str]) -> str | None:
        """An operand's in_specs entry (or entries, starred), or None for its one block spec."""
        return None

    def call_args(self, names_in: list[str]) -> list[str]:
        """The pallas_call's operands after the scalar-prefetch tables."""
        return names_in

    def bytes_code(self, names_in: list[str], one: bool) -> str:
        """pl.CostEstimate's bytes_accessed: every operand and output once."""
        return (
            f"_nbytes({', '.join(names_in)}{', ' if names_in else ''}{'out_shape' if one else '*out_shape'})"
        )

    def kernel_spec(self, lay: Layout, code: str) -> KernelSpec:
        """The spec the tuner and the block model read."""
        grid_axes, axis_dims, in_vars = lay.grid_axes, lay.axis_dims, lay.in_vars
        out_view, params = lay.out_view, lay.params
        # spec
        spec = KernelSpec(
            name=self.stem,
            family=self.family,
            title=self.title(),
            code=code,
            params=params,
            grid=[
                GridAxis(
                    name=f"{axis_dims[a].key}_index",
                    extent=1 if axis_dims[a].key in self.whole_grid else self.group_extent(axis_dims[a]),
                    param=axis_dims[a].param if axis_dims[a].role in ("tiled", "seq") else None,
                    semantics="arbitrary" if axis_dims[a].role == "seq" else "parallel",
                    align=self.align_of(axis_dims[a]),
                )
                for a in grid_axes
            ],
            buffers=self.buffers(in_vars, out_view),
            flops=self.flops(),
            mxu_passes=self.mxu_passes(),
            transcendentals=self.transcendentals,
            row_group=self.row_group(),
            notes=self.notes,
            structure=self.structure(),
        )
        return spec

    def row_group(self) -> int:
        """Rows folded into every row tile beside the tiled ones (see `KernelSpec.row_group`)."""
        return 1

    def call_expression(self, lay: Layout) -> str:
        """How computation() calls the wrapper."""
        low = self.low
        in_vars = lay.in_vars
        ckw = sorted(self.call_kw)
        call_args = ", ".join(low.name_of(v) for v in in_vars)
        call_kw = ", ".join(f"{k}={self.call_kw[k]}" for k in ckw)
        call = f"{self.stem}({call_args}{', ' if call_kw and call_args else ''}{call_kw})"
        return call

    def overhang_ok(self, d: SpaceDim) -> bool:
        """May the last block along `d` overhang the array edge instead of padding the operands in HBM
        (and cropping the results)? Pallas reads unspecified values past the edge and drops writes there,
        so this holds when padded positions only ever reach padded outputs or are masked in the kernel;
        a contraction (K) needs real zeros. Padding and cropping are whole-array copies in HBM."""
        return False

    def flops_code(self) -> str:
        """Flops of the whole call as an expression of the wrapper's extents (for pl.CostEstimate)."""
        n_ops = sum(1 for i in self.region.eqns() if self.g.kind[i] in ("elementwise", "reduce"))
        return f"{max(n_ops, 1)} * {self.space_size_code()}"

    def transcendentals_code(self) -> str:
        return f"{int(self.transcendentals)} * {self.space_size_code()}" if self.transcendentals else "0"

    def space_size_code(self, dims: list[SpaceDim] | None = None) -> str:
        dims = self.dims if dims is None else dims
        parts = [d.ext for d in dims if d.classes]
        return " * ".join(parts) if parts else "1"

    def kernel_doc(self) -> str:
        return self.title()

    def wrapper_doc(self, in_vars: list[Any]) -> str:
        return (
            f"{self.title()}. Lays the operands out for the kernel, pads, calls it, and restores the layout."
        )

    def param_doc(self, d: SpaceDim) -> str:
        return f"block along {d.key}"

    def structure(self) -> str:
        return ""

    def flops(self) -> float:
        return 0.0

    def mxu_passes(self) -> int:
        """bf16 MXU passes each of `flops()` costs (the tuner weighs MXU time against HBM time with it)."""
        return 1

    def buffers(self, in_vars: list[Any], out_view: list[SpaceDim]) -> list[BufferSpec]:
        out: list[BufferSpec] = []

        def dims_of(view: list[SpaceDim], var: Any) -> list[DimRef]:
            refs = []
            for d in view:
                if d.role == "grid" and d.key in self.whole_grid and self.spans(var, d):
                    refs.append(DimRef(kind="full", extent=self.group_extent(d)))
                elif d.role == "grid" or not self.spans(var, d):
                    refs.append(DimRef(kind="unit"))
                elif d.role in ("tiled", "seq") and d.param:
                    refs.append(
                        DimRef(
                            kind="param", param=d.param, extent=self.group_extent(d), align=self.align_of(d)
                        )
                    )
                else:
                    refs.append(DimRef(kind="full", extent=self.group_extent(d)))
            return refs

        grid_axes = sorted({d.axis for d in self.dims if d.axis is not None})
        for v in in_vars:
            view = self.input_view[v]
            axes = [grid_axes.index(d.axis) for d in view if d.axis is not None and self.spans(v, d)]
            out.append(
                BufferSpec(
                    what=f"{self.local(v)} block",
                    dims=dims_of(view, v),
                    itemsize=4 if dtype_name(v.aval) == "bool" else v.aval.dtype.itemsize,
                    copies=2,
                    kind="input",
                    axes=axes,
                    hbm_bytes=nbytes(v),
                )
            )
        for v in self.outputs:
            axes = [grid_axes.index(d.axis) for d in out_view if d.axis is not None and self.spans(v, d)]
            out.append(
                BufferSpec(
                    what="output block",
                    dims=dims_of(out_view, v),
                    itemsize=4 if dtype_name(v.aval) == "bool" else v.aval.dtype.itemsize,
                    copies=2,
                    kind="output",
                    axes=axes,
                    hbm_bytes=nbytes(v),
                )
            )
        for name, _dt, dims in self.scratch():
            refs = []
            for d in dims:
                if isinstance(d, str):
                    refs.append(DimRef(kind="full", extent=int(d)) if d.isdigit() else DimRef(kind="unit"))
                elif d.role in ("tiled", "seq") and d.param:
                    refs.append(
                        DimRef(
                            kind="param", param=d.param, extent=self.group_extent(d), align=self.align_of(d)
                        )
                    )
                else:
                    refs.append(DimRef(kind="full", extent=self.group_extent(d)))
            out.append(BufferSpec(what=name, dims=refs, itemsize=4, copies=1, kind="scratch"))
        out.extend(self.temporaries())
        return out

    def temporaries(self) -> list[BufferSpec]:
        return []

    def align_of(self, d: SpaceDim) -> int:
        """The alignment the generated `_block` applies to `d`'s block (1 before the layout is known), so
        the tuner's VMEM and traffic figures use the blocks the kernel really picks (an unaligned K of 5000
        at a 2048 target is padded to 3 x 2048, not split into 4 x 1250)."""
        return self.param_align.get(d.param or "", 1)

    def tile_refs(self, space: Space) -> list[DimRef]:
        refs = []
        for d in space.dims:
            if d.role in ("tiled", "seq") and d.param:
                refs.append(
                    DimRef(kind="param", param=d.param, extent=self.group_extent(d), align=self.align_of(d))
                )
            else:
                refs.append(DimRef(kind="full", extent=self.group_extent(d)))
        return refs


def nbytes(v: Any) -> int:
    """Bytes of a jaxpr var's whole array (a BufferSpec's HBM size, the block model's traffic)."""
    n = v.aval.dtype.itemsize
    for s in v.aval.shape:
        n *= int(s)
    return n


def _tuple(items: list[str]) -> str:
    if len(items) == 1:
        return f"({items[0]},)"
    return f"({', '.join(items)})"


def stem_of(prim: str) -> str:
    """A readable variable stem for a primitive's result in generated code."""
    return {
        "reduce_sum": "sum",
        "reduce_max": "max",
        "reduce_min": "min",
        "convert_element_type": "cast",
        "select_n": "select",
        "integer_pow": "pow",
        "logistic": "sigmoid",
        "broadcast_in_dim": "bcast",
        "dot_general": "dot",
    }.get(prim, prim.replace("_", ""))


def _constant_value(g: Any, var: Any, own: set[int]) -> float | None:
    """The value of a var that is a literal, or a broadcast/cast of one; None otherwise."""
    while True:
        if is_literal(var):
            return float(var.val)
        p = g.producer.get(var)
        if p is None or p not in own:
            return None
        e = g.eqns[p]
        if e.primitive.name not in (
            "convert_element_type",
            "broadcast_in_dim",
            "reshape",
            "squeeze",
            "expand_dims",
        ):
            return None
        var = e.invars[0]


def precision_arg(e: Any) -> str:
    """The `, precision=...` argument a kernel's dot needs to match an f32 reference dot's precision."""
    prec = e.params.get("precision")
    dt = dtype_name(e.invars[0].aval)
    if dt != "float32" or prec is None:
        return ""
    items = prec if isinstance(prec, tuple | list) else (prec,)
    names = {getattr(p, "name", str(p)) for p in items if p is not None}
    if "HIGHEST" in names:
        return ", precision=lax.Precision.HIGHEST"
    return ""


def nelems(v: Any) -> int:
    """Elements of a jaxpr var's array (at the primary trace's shapes)."""
    return math.prod(int(s) for s in v.aval.shape)


def op_summary(g: Any, region: Region, *, skip_dots: bool = False, limit: int = 8) -> str:
    """A region's work as a short list of op names, for kernel titles and plans."""
    names: list[str] = []
    for i in sorted(region.owned):
        e = g.eqns[i]
        k = g.kind[i]
        n = e.primitive.name
        if k == "absorbed" and n != "convert_element_type":
            continue
        if skip_dots and k == "dot":
            continue
        label = stem_of(n)
        if not names or names[-1] != label:
            names.append(label)
    if len(names) > limit:
        names = names[:limit] + ["..."]
    return ", ".join(names)


# Old private spellings, kept only while branches written before the family registry still import them.
