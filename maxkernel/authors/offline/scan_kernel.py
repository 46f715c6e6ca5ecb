"""A scan with a carried state (`lax.scan`, `fori_loop` with static bounds) as one Pallas kernel.

The grid has one sequential (`arbitrary`) step per iteration. The carry lives in VMEM scratch for the whole
loop: initialised from the `init` operand at step 0, read and overwritten at every step, and written to
the final-carry output at the last step (that output's block never moves, so it is stored once). Each step
receives its slice of every scanned input (`xs`, a block squeezed along the scanned axis) and writes its
slice of every stacked output (`ys`); loop-invariant operands are whole blocks fetched once. `reverse=True`
walks the index maps backwards. The body is re-emitted from the scan's own jaxpr, equation by equation.

Sizes in the body (broadcast shapes, iotas) are read off the operands' shapes, never copied from one
configuration: a size that differs between the task's configurations and matches no operand dim is refused.
Operands that the body only widens with unit dims (`x[:, :, None, None]`) are reshaped outside the kernel,
so the kernel never moves a vector's lane dim into a leading one (Mosaic has no such relayout).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from maxkernel.authors.offline.dataflow import is_literal
from maxkernel.authors.offline.emit import (
    EmitError,
    dtype_code,
    dtype_name,
    elementwise_expr,
    int_tuple,
    literal_code,
    shape_comment,
)
from maxkernel.authors.offline.kernels import KernelBuilder, LowerError, nbytes, precision_arg
from maxkernel.authors.offline.spec import BufferSpec, DimRef, GridAxis, KernelSpec
from maxkernel.tools.jaxpr import ELEMENTWISE

if TYPE_CHECKING:
    from maxkernel.authors.offline.lower import Lowering
    from maxkernel.authors.offline.partition import Region

MAX_STEP_BYTES = 48 * 2**20
"""VMEM for one step's operands, carries and outputs (double-buffered) must stay under this (the tuner's
VMEM budget is half the smallest generation's 128 MiB; this leaves room for the body's temporaries); a
scan whose state does not fit is refused rather than compiled into a kernel that cannot run."""

_REDUCE_FN = {"reduce_sum": "jnp.sum", "reduce_max": "jnp.max", "reduce_min": "jnp.min"}


def _widened_by(body: Any, var: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The shape `var` is widened to when every use in the body is a broadcast_in_dim that only inserts
    unit dims (the same shape each time), with where the var's own dims land; None otherwise."""
    target: tuple[int, ...] | None = None
    dims: tuple[int, ...] = ()
    used = False
    for e in body.eqns:
        if not any(v is var for v in e.invars if not is_literal(v)):
            continue
        used = True
        if e.primitive.name != "broadcast_in_dim":
            return None
        out = tuple(int(s) for s in e.outvars[0].aval.shape)
        bd = tuple(e.params["broadcast_dimensions"])
        src = tuple(int(s) for s in var.aval.shape)
        if any(out[k] != 1 for k in range(len(out)) if k not in bd):
            return None
        if any(src[i] != out[bd[i]] for i in range(len(src))) or list(bd) != sorted(bd):
            return None
        if target is not None and target != out:
            return None
        target, dims = out, bd
    return (target, dims) if used and target is not None else None


class ScanBuilder(KernelBuilder):
    family = "scan"

    def __init__(self, low: Lowering, region: Region, index: int, n_kernels: int) -> None:
        super().__init__(low, region, index, n_kernels)
        self.eqn = self.g.eqns[min(region.owned)]
        if len(region.owned) != 1:
            raise LowerError("a scan kernel holds exactly one scan")
        p = self.eqn.params
        self.n_consts = int(p["num_consts"])
        self.n_carry = int(p["num_carry"])
        self.body = p["jaxpr"].jaxpr
        if p["jaxpr"].consts:
            raise LowerError("a scan body with captured constants")
        self.bodies = [a.params["jaxpr"].jaxpr for a in low.traces.aligned_eqns(self.eqn)]
        names = [[e.primitive.name for e in b.eqns] for b in self.bodies]
        if any(n != names[0] for n in names):
            raise LowerError("the scan body's structure changes with the input shapes")
        self.code_of: dict[Any, str] = {}
        self.lines: list[str] = []
        self.counter = 0
        self.flop_count = 0.0

    # --- sizes ----------------------------------------------------------------------------------------
    def _shapes(self, pos: int, var: Any) -> list[tuple[int, ...]]:
        """A body var's shape in every configuration (var found by position in the primary body)."""
        where = self._position(var)
        out = []
        for b in self.bodies:
            kind, i, k = where
            v = b.invars[i] if kind == "in" else b.eqns[i].outvars[k]
            out.append(tuple(int(s) for s in v.aval.shape))
        return out

    def _position(self, var: Any) -> tuple[str, int, int]:
        for i, v in enumerate(self.body.invars):
            if v is var:
                return ("in", i, 0)
        for i, e in enumerate(self.body.eqns):
            for k, v in enumerate(e.outvars):
                if v is var:
                    return ("eqn", i, k)
        raise AssertionError("a var outside the scan body")

    def size_code(self, per_config: list[int], side: str = "kernel") -> str:
        """A size as code: a constant when every configuration agrees, else an operand's dim (read off the
        kernel's refs, or off the wrapper's arrays)."""
        if all(v == per_config[0] for v in per_config):
            return str(per_config[0])
        for code, vals in self.atoms[side]:
            if vals == per_config:
                return code
        raise LowerError("a size in the scan body that no operand's shape gives")

    def shape_code(self, var: Any, side: str = "kernel") -> str:
        shapes = self._shapes(0, var)
        dims = [self.size_code([s[j] for s in shapes], side) for j in range(len(shapes[0]))]
        return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"

    # --- the body -------------------------------------------------------------------------------------
    def fresh(self, stem: str) -> str:
        self.counter += 1
        return f"{stem}{self.counter}"

    def arg(self, v: Any) -> str:
        if is_literal(v):
            return literal_code(v.val, dtype_name(v.aval))
        return self.code_of[v]

    def emit(self, e: Any) -> None:
        name = e.primitive.name
        out = e.outvars[0]
        dt = dtype_name(out.aval)
        ins = [v for v in e.invars]
        comment = "  # " + shape_comment(dt, [str(s) for s in out.aval.shape])
        if name == "broadcast_in_dim" and not is_literal(ins[0]) and ins[0] in self.widened:
            self.code_of[out] = self.code_of[ins[0]]  # already widened outside the kernel
            return
        if name in ELEMENTWISE or name == "convert_element_type":
            try:
                expr = elementwise_expr(
                    e,
                    [self.arg(v) for v in ins],
                    dt,
                    [dtype_name(v.aval) for v in ins],
                    len(out.aval.shape) == 0,
                )
            except EmitError as exc:
                raise LowerError(str(exc)) from exc
            self.flop_count += math.prod(int(s) for s in out.aval.shape)
        elif name == "broadcast_in_dim":
            expr = (
                f"lax.broadcast_in_dim({self.arg(ins[0])}, {self.shape_code(out)}, "
                f"{int_tuple(e.params['broadcast_dimensions'])})"
            )
        elif name in ("reshape", "squeeze", "expand_dims"):
            expr = f"{self.arg(ins[0])}.reshape({self.shape_code(out)})"
        elif name == "transpose":
            expr = f"jnp.transpose({self.arg(ins[0])}, {int_tuple(e.params['permutation'])})"
        elif name in ("copy", "copy_p"):
            expr = self.arg(ins[0])
        elif name == "iota":
            expr = f"lax.broadcasted_iota({dtype_code(dt)}, {self.shape_code(out)}, {e.params['dimension']})"
        elif name in _REDUCE_FN:
            expr = f"{_REDUCE_FN[name]}({self.arg(ins[0])}, axis={int_tuple(e.params['axes'])})"
            self.flop_count += math.prod(int(s) for s in ins[0].aval.shape)
        elif name == "dot_general":
            (lc, rc), (lb, rb) = e.params["dimension_numbers"]
            pref = e.params.get("preferred_element_type")
            pref_code = dtype_code(dtype_name(out.aval)) if pref is not None else "None"
            expr = (
                f"lax.dot_general({self.arg(ins[0])}, {self.arg(ins[1])}, "
                f"(({int_tuple(lc)}, {int_tuple(rc)}), ({int_tuple(lb)}, {int_tuple(rb)})), "
                f"preferred_element_type={pref_code}{precision_arg(e)})"
            )
            k = math.prod(int(ins[0].aval.shape[a]) for a in lc)
            self.flop_count += 2.0 * k * math.prod(int(s) for s in out.aval.shape)
        else:
            raise LowerError(f"`{name}` cannot run inside a scan kernel")
        nm = self.fresh("v")
        self.lines.append(f"{nm} = {expr}{comment}")
        self.code_of[out] = nm

    # --- the kernel -----------------------------------------------------------------------------------
    def build(self) -> tuple[KernelSpec, str]:
        e = self.eqn
        s, c = self.stem, self.cprefix
        body = self.body
        n_in = len(e.invars)
        n_xs = n_in - self.n_consts - self.n_carry
        roles = ["const"] * self.n_consts + ["init"] * self.n_carry + ["xs"] * n_xs
        used_outs = set(self.outputs)
        if any(is_literal(v) for v in e.invars[: self.n_consts]) or any(
            is_literal(v) for v in e.invars[self.n_consts + self.n_carry :]
        ):
            raise LowerError("a literal scanned operand")
        # operands: every non-literal invar position, widened where the body only adds unit dims
        self.widened: dict[Any, tuple[int, ...]] = {}
        operands: list[tuple[int, str]] = []  # (invar position, kernel-side name)
        wrapper: list[str] = []
        names_in: list[str] = []
        for pos, v in enumerate(e.invars):
            if is_literal(v):
                continue
            nm = self.low.name_of(v)
            if nm not in names_in:
                names_in.append(nm)
            local = f"op{pos}"
            operands.append((pos, local))
            bv = body.invars[pos]
            if roles[pos] != "init":
                found = _widened_by(body, bv)
                if found is not None and len(found[0]) > len(bv.aval.shape):
                    wide, where = found
                    self.widened[bv] = wide
                    lead = 1 if roles[pos] == "xs" else 0
                    dims = [f"{nm}.shape[0]"] * lead + [
                        f"{nm}.shape[{lead + where.index(k)}]" if k in where else "1"
                        for k in range(len(wide))
                    ]
                    wrapper.append(f"{local} = {nm}.reshape({', '.join(dims)})  # unit dims the body adds")
                    continue
            wrapper.append(f"{local} = {nm}")
        # sizes the body may need: the operands' dims (per step for xs), across configurations
        self.atoms: dict[str, list[tuple[str, list[int]]]] = {"kernel": [], "wrapper": []}
        for pos, local in operands:
            if body.invars[pos] in self.widened:
                continue  # its arrays no longer have the body var's dims
            bvs = [b.invars[pos] for b in self.bodies]
            lead = 1 if roles[pos] == "xs" else 0
            for d in range(len(bvs[0].aval.shape)):
                vals = [int(b.aval.shape[d]) for b in bvs]
                self.atoms["kernel"].append((f"{local}_ref.shape[{d}]", vals))
                self.atoms["wrapper"].append((f"{local}.shape[{d + lead}]", vals))
        # kernel
        refs_in = [f"{local}_ref" for _, local in operands]
        carries = list(range(self.n_carry))
        final_outs = [k for k in carries if e.outvars[k] in used_outs]
        ys_outs = [k for k in range(self.n_carry, len(e.outvars)) if e.outvars[k] in used_outs]
        out_refs = [f"final{k}_ref" for k in final_outs] + [f"ys{k}_ref" for k in ys_outs]
        scratch = [f"carry{k}_ref" for k in carries]
        klines: list[str] = []
        klines.append("t_index = pl.program_id(0)")
        klines.append("")
        klines.append("@pl.when(t_index == 0)")
        klines.append("def _init():")
        for k in carries:
            v = e.invars[self.n_consts + k]
            src = (
                f"jnp.full(carry{k}_ref.shape, {literal_code(v.val, dtype_name(v.aval))})"
                if is_literal(v)
                else f"op{self.n_consts + k}_ref[...]"
            )
            klines.append(f"    carry{k}_ref[...] = {src}.astype(carry{k}_ref.dtype)")
        klines.append("")
        for pos, local in operands:
            bv = body.invars[pos]
            if roles[pos] == "init":
                continue
            nm = self.fresh("x" if roles[pos] == "xs" else "c")
            shape = self.widened.get(bv, tuple(int(x) for x in bv.aval.shape))
            dt = dtype_name(bv.aval)
            klines.append(
                f"{nm} = {local}_ref[...]  # {shape_comment(dt, [str(x) for x in shape])} ({roles[pos]})"
            )
            self.code_of[bv] = nm
        for k in carries:
            bv = body.invars[self.n_consts + k]
            nm = self.fresh("carry")
            dt = dtype_name(bv.aval)
            klines.append(f"{nm} = carry{k}_ref[...]  # {shape_comment(dt, [str(x) for x in bv.aval.shape])}")
            self.code_of[bv] = nm
        for eq in body.eqns:
            self.emit(eq)
        klines += self.lines
        for k in ys_outs:
            klines.append(f"ys{k}_ref[...] = {self.arg(body.outvars[k])}.astype(ys{k}_ref.dtype)")
        for k in carries:
            klines.append(f"carry{k}_ref[...] = {self.arg(body.outvars[k])}.astype(carry{k}_ref.dtype)")
        if final_outs:
            klines.append("")
            klines.append("@pl.when(t_index == pl.num_programs(0) - 1)")
            klines.append("def _final():")
            for k in final_outs:
                klines.append(f"    final{k}_ref[...] = carry{k}_ref[...].astype(final{k}_ref.dtype)")
        sig = ", ".join([*refs_in, *out_refs, *scratch])
        kernel = [
            f"def {s}_kernel({sig}):",
            '    """One loop iteration per grid step; the carried state stays in VMEM scratch."""',
        ]
        kernel += [("    " + ln) if ln else "" for ln in klines]
        # index maps
        rev = bool(e.params["reverse"])
        step = "n_steps - 1 - t_index" if rev else "t_index"
        maps = [
            f"def {s}_step_index_map(t_index, *, rank, n_steps):\n    return ({step},) + (0,) * (rank - 1)\n",
            f"def {s}_whole_index_map(t_index, *, rank):\n    return (0,) * rank\n",
        ]
        # wrapper
        length = [int(a.params["length"]) for a in self.low.traces.aligned_eqns(e)]
        xs_pos = [pos for pos, _ in operands if roles[pos] == "xs"]
        if xs_pos:
            n_steps = f"op{xs_pos[0]}.shape[0]"
        elif all(n == length[0] for n in length):
            n_steps = str(length[0])
        else:
            n_steps = self.low.resolve_extent(length)
        w = [
            f"def {s}({', '.join(names_in)}):",
            '    """lax.scan as one Pallas kernel: a sequential grid over the iterations, the carry in VMEM."""',
        ]
        w += ["    " + ln for ln in wrapper]
        w.append(f"    n_steps = {n_steps}")
        in_specs = []
        for pos, local in operands:
            if roles[pos] == "xs":
                in_specs.append(
                    f"pl.BlockSpec((None, *{local}.shape[1:]), functools.partial({s}_step_index_map, "
                    f"rank={local}.ndim, n_steps=n_steps))"
                )
            else:
                in_specs.append(
                    f"pl.BlockSpec({local}.shape, functools.partial({s}_whole_index_map, rank={local}.ndim))"
                )
        out_shapes, out_specs = [], []
        for k in final_outs:
            init = e.invars[self.n_consts + k]
            v = e.outvars[k]
            shape = (
                f"op{self.n_consts + k}.shape"
                if not is_literal(init)
                else self.shape_code(body.invars[self.n_consts + k], "wrapper")
            )
            out_shapes.append(f"jax.ShapeDtypeStruct({shape}, {dtype_code(dtype_name(v.aval))})")
            out_specs.append(
                f"pl.BlockSpec({shape}, functools.partial({s}_whole_index_map, rank={len(v.aval.shape)}))"
            )
        for k in ys_outs:
            v = e.outvars[k]
            bv = body.outvars[k]
            per = self.shape_code(bv, "wrapper") if not is_literal(bv) else "()"
            out_shapes.append(f"jax.ShapeDtypeStruct((n_steps, *{per}), {dtype_code(dtype_name(v.aval))})")
            out_specs.append(
                f"pl.BlockSpec((None, *{per}), functools.partial({s}_step_index_map, "
                f"rank={len(v.aval.shape)}, n_steps=n_steps))"
            )
        scratch_shapes = []
        for k in carries:
            bv = body.invars[self.n_consts + k]
            init = e.invars[self.n_consts + k]
            shape = f"op{self.n_consts + k}.shape" if not is_literal(init) else self.shape_code(bv, "wrapper")
            scratch_shapes.append(f"pltpu.VMEM({shape}, {dtype_code(dtype_name(bv.aval))})")
        w.append("    out_shape = [")
        w += [f"        {x}," for x in out_shapes]
        w.append("    ]")
        w.append("    cost = pl.CostEstimate(")
        w.append(f"        flops={int(self.flop_count)} * n_steps,")
        w.append("        transcendentals=0,")
        w.append(f"        bytes_accessed=_nbytes({', '.join(local for _, local in operands)}, *out_shape),")
        w.append("    )")
        w.append("    outs = pl.pallas_call(")
        w.append(f"        {s}_kernel,")
        w.append("        grid=(n_steps,),")
        w.append("        in_specs=[")
        w += [f"            {x}," for x in in_specs]
        w.append("        ],")
        w.append("        out_specs=[")
        w += [f"            {x}," for x in out_specs]
        w.append("        ],")
        w.append("        out_shape=out_shape,")
        w.append(f"        scratch_shapes=[{', '.join(scratch_shapes)}],")
        w.append("        compiler_params=pltpu.CompilerParams(")
        w.append('            dimension_semantics=("arbitrary",),')
        w.append(f"            vmem_limit_bytes={c}VMEM_LIMIT_BYTES,")
        w.append("        ),")
        w.append("        cost_estimate=cost,")
        w.append(f"    )({', '.join(local for _, local in operands)})")
        order = [e.outvars[k] for k in [*final_outs, *ys_outs]]  # outs[i] has the reference's shape
        ret = [f"outs[{order.index(v)}]" for v in self.outputs]
        w.append(f"    return {', '.join(ret)}")
        code = "\n\n".join([*maps, "\n".join(kernel) + "\n", "\n".join(w) + "\n"])
        spec = KernelSpec(
            name=s,
            family=self.family,
            title=f"lax.scan over {length[0]} steps with the carry in VMEM",
            code=code,
            params=[],
            grid=[GridAxis(name="t_index", extent=length[0], param=None, semantics="arbitrary")],
            buffers=self._buffers(operands, roles, final_outs, ys_outs),
            flops=self.flop_count * length[0],
            structure=(
                "grid (iterations,) sequential; loop-invariant operands fetched once, each iteration's slice "
                "of the scanned operands fetched per step, the carry kept in VMEM scratch across steps"
            ),
            notes=["the iterations are sequential by definition: no grid axis can be split across cores"],
        )
        vm = sum(b.vmem_bytes({}) for b in spec.buffers)
        if vm > MAX_STEP_BYTES:
            raise LowerError(f"a scan whose per-step state needs {vm / 2**20:.0f} MiB of VMEM")
        call = f"{s}({', '.join(names_in)})"
        return spec, call

    def _buffers(
        self, operands: list[tuple[int, str]], roles: list[str], final_outs: list[int], ys_outs: list[int]
    ) -> list[BufferSpec]:
        e = self.eqn
        out: list[BufferSpec] = []

        def whole(shape: tuple[int, ...]) -> list[DimRef]:
            return [DimRef(kind="full", extent=int(x)) for x in shape] or [DimRef(kind="unit")]

        for pos, local in operands:
            v = e.invars[pos]
            bv = self.body.invars[pos]
            shape = self.widened.get(bv, tuple(int(x) for x in bv.aval.shape))
            out.append(
                BufferSpec(
                    what=f"{local} ({roles[pos]}) block",
                    dims=whole(shape),
                    itemsize=v.aval.dtype.itemsize,
                    kind="input",
                    axes=[0] if roles[pos] == "xs" else [],
                    hbm_bytes=nbytes(v),
                )
            )
        for k in [*final_outs, *ys_outs]:
            v = e.outvars[k]
            bv = self.body.outvars[k]
            shape = tuple(int(x) for x in bv.aval.shape) if not is_literal(bv) else ()
            out.append(
                BufferSpec(
                    what=f"output {k} block",
                    dims=whole(shape),
                    itemsize=v.aval.dtype.itemsize,
                    kind="output",
                    axes=[0] if k >= self.n_carry else [],
                    hbm_bytes=nbytes(v),
                )
            )
        for k in range(self.n_carry):
            bv = self.body.invars[self.n_consts + k]
            out.append(
                BufferSpec(
                    what=f"carry{k}_ref",
                    dims=whole(tuple(int(x) for x in bv.aval.shape)),
                    itemsize=bv.aval.dtype.itemsize,
                    copies=1,
                    kind="scratch",
                )
            )
        return out
