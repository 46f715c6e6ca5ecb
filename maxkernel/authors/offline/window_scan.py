"""A scan whose state is too large for VMEM, read and written through windows (`lax.dynamic_slice`).

A loop over groups that multiplies a window of rows by the group's weights and accumulates the result into
a window of a large carried buffer (the grouped-matmul reference of a mixture of experts: a `lax.scan`
over experts with `dynamic_slice` of the tokens, `rhs[i]`, a row mask and a read-modify-write of the
output through `dynamic_slice` / `dynamic_update_slice`) keeps nothing whole in VMEM. Here:

* the carry stays in HBM (`pl.ANY`), aliased from its initial value to the kernel's output; each
  iteration reads the rows it reads and writes the rows it writes by DMA, waited for in program order;
* every loop-invariant operand the body reads only through one `dynamic_slice` (rows along its first
  dim, the other dims whole) stays in HBM too, and its window for the next iteration is copied while this
  one computes (two VMEM slots);
* small integer tables the body indexes with a scalar (group offsets, group sizes) and the scanned
  integers go to SMEM by scalar prefetch; the body's scalar arithmetic is one function of the iteration,
  evaluated for this iteration and for the next (whose windows are being fetched);
* the rest of the body is re-emitted equation by equation, as in `ScanBuilder`.

Windows start where `dynamic_slice` says, clamped as it clamps. A DMA from or to HBM must start on a
sublane tile boundary of a 2-D array, so a window of rows of one is copied as the aligned rows around it
(`ALIGN_ROWS` more) and shifted into place in VMEM by a sublane rotation in float32; arrays of rank three
and more slice their untiled first dim directly. Only the rows `dynamic_update_slice` replaces change:
the rest of an aligned window is written back as it was read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from maxkernel.authors.offline.dataflow import is_literal
from maxkernel.authors.offline.emit import EmitError, dtype_code, dtype_name, elementwise_expr, literal_code
from maxkernel.authors.offline.kernels import LowerError, nbytes
from maxkernel.authors.offline.scan_kernel import MAX_STEP_BYTES, ScanBuilder
from maxkernel.authors.offline.spec import BufferSpec, DimRef, GridAxis, KernelSpec
from maxkernel.authors.offline.trace import _inline_calls
from maxkernel.tools.jaxpr import CALL_PRIMITIVES, ELEMENTWISE

SCALAR_PRIMITIVES = frozenset(
    {"squeeze", "reshape", "convert_element_type", "select_n", "clamp", "dynamic_slice"}
) | frozenset(ELEMENTWISE)
"""What the body's scalar arithmetic (offsets, counts, the iteration) may use."""


def align_rows(itemsize: int) -> int:
    """Rows of one sublane tile in HBM for this element size: 8 of 32-bit, 16 of 16-bit, 32 of 8-bit."""
    return {1: 32, 2: 16}.get(itemsize, 8)


@dataclass
class Window:
    """One `dynamic_slice` of rows of an HBM operand (a loop-invariant one, or the carry)."""

    eqn: Any
    pos: int  # the body invar position it slices
    rows: str  # its row count as code (a constant or a kernel parameter)
    aligned: bool  # a 2-D array: copied as the aligned rows around it, then rotated into place
    ref: str = ""
    buf: str = ""
    itemsize: int = 4  # of the array it slices

    @property
    def align(self) -> int:
        """Rows an aligned copy starts on, and adds (`align_rows`)."""
        return align_rows(self.itemsize)


@dataclass
class Plan:
    carry: int = 0  # the body invar position of the array carry
    counters: dict[int, int] = field(
        default_factory=dict
    )  # body invar position -> start: a fori_loop's index
    tables: list[int] = field(default_factory=list)  # const positions: int vectors read by a scalar index
    steps: list[int] = field(default_factory=list)  # xs positions: one integer per iteration
    windows: list[Window] = field(default_factory=list)  # const windows (double-buffered)
    reads: list[Window] = field(default_factory=list)  # carry windows read
    write: Any = None  # the dynamic_update_slice that makes the new carry
    scalar_eqns: list[Any] = field(default_factory=list)


CARRY_REF = "carry_hbm"
"""The kernel's name for its output ref: the carry, in HBM, aliased from the initial carry."""


@dataclass
class _Layout:
    """How one windowed scan's kernel addresses its operands (`WindowScanBuilder._layout`)."""

    prefetch: list[int]  # scan operand positions passed by scalar prefetch
    hbm: list[int]  # ... left in HBM (the windows' operands; the carry's init comes after them)
    names_in: list[str] = field(default_factory=list)  # the wrapper's array arguments
    locals: dict[int, str] = field(default_factory=dict)  # operand position -> its name in the wrapper
    params: list[str] = field(default_factory=list)  # row counts bound by the wrapper
    wrapper_sizes: list[str] = field(default_factory=list)  # ... as the caller computes them
    write: Window = None  # type: ignore[assignment]


def _full_after_first(e: Any, operand: Any) -> bool:
    sizes = tuple(int(s) for s in e.params["slice_sizes"])
    return sizes[1:] == tuple(int(s) for s in operand.aval.shape[1:])


def _counter_start(body: Any, n_consts: int, k: int, init: Any) -> int | None:
    """The start of a carried loop index (`fori_loop`'s `i`: an integer scalar that the body returns plus
    one, from a literal start), or None."""
    v = body.invars[n_consts + k]
    if tuple(v.aval.shape) != () or v.aval.dtype.kind not in "iu" or not is_literal(init):
        return None
    out = body.outvars[k]
    producer = next((e for e in body.eqns if out in e.outvars), None)
    if producer is None or producer.primitive.name != "add":
        return None
    a, b = producer.invars
    one = b if a is v else a if b is v else None
    return int(init.val) if one is not None and is_literal(one) and int(one.val) == 1 else None


def plan_windows(body: Any, n_consts: int, n_carry: int, inits: list[Any] | None = None) -> Plan | None:
    """How a scan body's operands are moved, or None when no operand is read through windows (the plain
    `ScanBuilder` takes it). `inits`: the scan's initial carries (a loop index starts from a literal).
    Raises LowerError for a windowed body outside what this builder does."""
    uses: dict[Any, list[tuple[Any, int]]] = {}
    for e in body.eqns:
        for k, v in enumerate(e.invars):
            if not is_literal(v):
                uses.setdefault(v, []).append((e, k))
    inits = inits or [None] * n_carry
    counters = {
        n_consts + k: start
        for k in range(n_carry)
        if (start := _counter_start(body, n_consts, k, inits[k])) is not None
    }
    arrays = [n_consts + k for k in range(n_carry) if n_consts + k not in counters]
    carry = body.invars[arrays[0]] if len(arrays) == 1 else None
    carry_windowed = carry is not None and any(
        e.primitive.name in ("dynamic_slice", "dynamic_update_slice") and k == 0
        for e, k in uses.get(carry, [])
    )
    const_windowed = any(
        len(body.invars[p].aval.shape) >= 2
        and len(uses.get(body.invars[p], [])) == 1
        and uses[body.invars[p]][0][0].primitive.name == "dynamic_slice"
        and uses[body.invars[p]][0][1] == 0
        for p in range(n_consts)
    )
    if not carry_windowed and not const_windowed:
        return None
    if carry is None:
        raise LowerError("a windowed scan with more than one carried array")
    plan = Plan(carry=arrays[0], counters=counters)
    scalars: set[Any] = {body.invars[p] for p in counters}
    for pos, v in enumerate(body.invars):
        us = uses.get(v, [])
        if pos == plan.carry or pos in counters or not us:
            continue
        shape = tuple(v.aval.shape)
        integer = v.aval.dtype.kind in "iu"
        if pos >= n_consts + n_carry:  # scanned: one value per iteration
            if shape != () or not integer:
                raise LowerError("a windowed scan whose scanned operand is not one integer per iteration")
            plan.steps.append(pos)
            scalars.add(v)
        elif (
            len(shape) == 1
            and integer
            and all(
                e.primitive.name == "dynamic_slice" and k == 0 and tuple(e.params["slice_sizes"]) == (1,)
                for e, k in us
            )
        ):
            plan.tables.append(pos)
        elif (
            len(shape) >= 2 and len(us) == 1 and us[0][0].primitive.name == "dynamic_slice" and us[0][1] == 0
        ):
            e = us[0][0]
            if not _full_after_first(e, v):
                raise LowerError("a window of a loop-invariant operand that is not whole rows")
            plan.windows.append(Window(e, pos, "", _aligned(e, v), itemsize=v.aval.dtype.itemsize))
        else:
            raise LowerError("a loop-invariant operand of a windowed scan used other than through one window")
    for e, k in uses.get(carry, []):
        name = e.primitive.name
        if name == "dynamic_slice" and k == 0 and _full_after_first(e, carry):
            plan.reads.append(
                Window(e, plan.carry, "", _aligned(e, carry), itemsize=carry.aval.dtype.itemsize)
            )
        elif (
            name == "dynamic_update_slice"
            and k == 0
            and e.outvars[0] is body.outvars[plan.carry - n_consts]
            and plan.write is None
        ):
            upd = e.invars[1].aval.shape
            if tuple(upd[1:]) != tuple(carry.aval.shape[1:]):
                raise LowerError("a windowed scan that writes other than whole rows of its carry")
            plan.write = e
        else:
            raise LowerError("the carry of a windowed scan used other than through row windows")
    if plan.write is None:
        raise LowerError("a windowed scan whose carry is not written through one dynamic_update_slice")
    if len(body.outvars) != n_carry:
        raise LowerError("a windowed scan with stacked outputs")
    for e in body.eqns:  # the scalar arithmetic: offsets and counts from the tables and the iteration
        ins = [v for v in e.invars if not is_literal(v)]
        table_read = e.primitive.name == "dynamic_slice" and e.invars[0] in {
            body.invars[p] for p in plan.tables
        }
        if (table_read or all(v in scalars for v in ins)) and all(
            math.prod(o.aval.shape) == 1 for o in e.outvars
        ):
            if e.primitive.name not in SCALAR_PRIMITIVES:
                raise LowerError(f"`{e.primitive.name}` in the scalar arithmetic of a windowed scan")
            plan.scalar_eqns.append(e)
            scalars.update(e.outvars)
    for e in [*(w.eqn for w in plan.windows), *(w.eqn for w in plan.reads), plan.write]:
        first = 2 if e.primitive.name == "dynamic_update_slice" else 1
        if any(not is_literal(v) and v not in scalars for v in e.invars[first:]):
            raise LowerError("a window of a scan whose start is not scalar arithmetic on the iteration")
    return plan


def _aligned(e: Any, operand: Any) -> bool:
    """A window of rows of a 2-D array that neither is one row nor the whole array: its start is a sublane
    offset, so it is copied as the aligned rows around it (float operands only: rotated in float32)."""
    rows = (
        int(e.params["slice_sizes"][0])
        if e.primitive.name == "dynamic_slice"
        else int(e.invars[1].aval.shape[0])
    )
    if len(operand.aval.shape) != 2 or rows in (1, int(operand.aval.shape[0])):
        return False
    if "float" not in operand.aval.dtype.name:
        raise LowerError("an unaligned row window of a non-float array in a windowed scan")
    return True


def inlined_body(closed: Any) -> Any:
    """A scan body with its calls (`jnp.where`'s `jit`, ...) inlined, as the trace inlines the top level;
    the body unchanged when it has none."""
    if not any(e.primitive.name in CALL_PRIMITIVES for e in closed.jaxpr.eqns):
        return closed.jaxpr
    import jax

    specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    return _inline_calls(closed, specs).jaxpr


class WindowScanBuilder(ScanBuilder):
    """`ScanBuilder` for a scan whose carry or loop-invariant operands are read through windows."""

    def __init__(self, low: Any, region: Any, index: int, n_kernels: int) -> None:
        super().__init__(low, region, index, n_kernels)
        self.body = inlined_body(self.eqn.params["jaxpr"])
        self.bodies = [inlined_body(a.params["jaxpr"]) for a in low.traces.aligned_eqns(self.eqn)]
        names = [[e.primitive.name for e in b.eqns] for b in self.bodies]
        if any(n != names[0] for n in names):
            raise LowerError("the scan body's structure changes with the input shapes")

    def build(self) -> tuple[KernelSpec, str]:
        inits = list(self.eqn.invars[self.n_consts : self.n_consts + self.n_carry])
        plan = plan_windows(self.body, self.n_consts, self.n_carry, inits)
        if plan is None:
            return super().build()
        return self._build_windowed(plan)

    # --- pieces ---------------------------------------------------------------------------------------
    def _rows(self, e: Any) -> list[int]:
        """A window's row count in every configuration (its eqn found by position in each body)."""
        i = self.body.eqns.index(e)
        out = []
        for b in self.bodies:
            be = b.eqns[i]
            if be.primitive.name == "dynamic_slice":
                out.append(int(be.params["slice_sizes"][0]))
            else:
                out.append(int(be.invars[1].aval.shape[0]))
        return out

    def _scalar_code(self, v: Any, tup: str) -> str:
        if is_literal(v):
            return literal_code(v.val, dtype_name(v.aval))
        return f"{tup}[{self.scalar_index[v]}]"

    def _emit_scalars(self, plan: Plan, tables: dict[int, str], steps: dict[int, str]) -> list[str]:
        """`_scal(u)`: the body's scalar values at iteration u, as a tuple (CSE'd by expression)."""
        lines = ["def _scal(u):"]
        code: dict[Any, str] = {}
        for pos, ref in steps.items():
            code[self.body.invars[pos]] = f"{ref}[u]"
        for pos, start in plan.counters.items():
            code[self.body.invars[pos]] = f"({start} + u)"
        by_expr: dict[str, str] = {}
        n = 0
        for e in plan.scalar_eqns:
            name = e.primitive.name
            first = 1 if name == "dynamic_slice" else 0  # a table is read, not computed
            args = [self._literal_or(code, e, k) for k in range(first, len(e.invars))]
            out = e.outvars[0]
            dt = dtype_name(out.aval)
            if name == "dynamic_slice":
                table = tables[self.body.invars.index(e.invars[0])]
                expr = f"{table}[jnp.clip({args[0]}, 0, {table}.shape[0] - 1)]"
            elif name in ("squeeze", "reshape"):
                expr = args[0]
            elif name == "clamp":
                expr = f"jnp.clip({args[1]}, {args[0]}, {args[2]})"
            else:
                try:
                    expr = elementwise_expr(e, args, dt, [dtype_name(v.aval) for v in e.invars], True)
                except EmitError as exc:
                    raise LowerError(str(exc)) from exc
            if expr not in by_expr:
                n += 1
                by_expr[expr] = f"s{n}"
                lines.append(f"    s{n} = {expr}")
            code[out] = by_expr[expr]
        names = list(dict.fromkeys(code.values()))
        self.scalar_index = {v: names.index(c) for v, c in code.items()}
        lines.append(f"    return ({', '.join(names)}{',' if len(names) == 1 else ''})")
        return lines

    def _literal_or(self, code: dict[Any, str], e: Any, k: int) -> str:
        """Operand k of a scalar equation as code: its value's name, or a literal, which may be a size that
        changes with the configuration (a negative index wrapped by the dim it indexes: `i + 32768`)."""
        v = e.invars[k]
        if not is_literal(v):
            return code[v]
        i = self.body.eqns.index(e)
        vals = [b.eqns[i].invars[k] for b in self.bodies]
        if all(is_literal(x) and x.val == v.val for x in vals) or v.aval.dtype.kind not in "iu":
            return literal_code(v.val, dtype_name(v.aval))
        return self.size_code([int(x.val) for x in vals])

    def _start_code(self, w: Window, tup: str, rows: str) -> list[str]:
        """Lines that set `s_{buf}` (the clamped start row) and, for an aligned window, `a_{buf}` (the aligned
        row the copy starts at)."""
        e = w.eqn
        v = e.invars[2 if e.primitive.name == "dynamic_update_slice" else 1]
        b = w.buf
        lines = [f"s_{b} = jnp.clip({self._scalar_code(v, tup)}, 0, {w.ref}.shape[0] - {rows})"]
        if w.aligned:
            a = w.align
            lines.append(f"a_{b} = jnp.minimum(lax.div(s_{b}, {a}) * {a}, {w.ref}.shape[0] - ({rows} + {a}))")
        return lines

    def _copy_code(self, w: Window, rows: str, slot: str | None, sem: str, to_hbm: bool = False) -> str:
        dst = f"{w.buf}.at[{slot}]" if slot is not None else w.buf
        if w.aligned:
            a = w.align
            src = f"{w.ref}.at[pl.ds(pl.multiple_of(a_{w.buf}, {a}), {rows} + {a})]"
        else:
            src = f"{w.ref}.at[pl.ds(s_{w.buf}, {rows})]"
        if to_hbm:
            src, dst = dst, src
        return f"pltpu.make_async_copy({src}, {dst}, {sem})"

    # --- the kernel -----------------------------------------------------------------------------------
    def _build_windowed(self, plan: Plan) -> tuple[KernelSpec, str]:
        e = self.eqn
        if any(is_literal(v) for i, v in enumerate(e.invars) if i != plan.carry and i not in plan.counters):
            raise LowerError("a literal scanned operand")
        if e.params["reverse"] and plan.counters:
            raise LowerError("a reversed windowed scan with a loop index")
        final = e.outvars[plan.carry - self.n_consts]
        if any(v is not final for v in self.outputs):
            raise LowerError("a windowed scan whose loop index is used after the loop")
        lay = self._layout(plan)
        length = [int(a.params["length"]) for a in self.low.traces.aligned_eqns(e)]
        code = self._kernel_code(plan, lay) + "\n\n\n" + self._wrapper_code(plan, lay, length)
        spec = KernelSpec(
            name=self.stem,
            family=self.family,
            title=f"lax.scan over {length[0]} steps with its carry in HBM, read and written through row windows",
            code=code,
            params=[],
            grid=[GridAxis(name="t_index", extent=length[0], param=None, semantics="arbitrary")],
            buffers=self._window_buffers(plan, lay.write),
            flops=self.flop_count * length[0],
            structure=(
                "grid (iterations,) sequential; small integer tables and the scanned integers in SMEM by scalar "
                "prefetch; each large operand's window for the next iteration copied by DMA while this one "
                "computes; the carry read and written in HBM through its row windows"
            ),
            notes=[
                "the iterations are sequential by definition: no grid axis can be split across cores",
                "a window of a 2-D array starts on any row: it is copied as the aligned rows around it and "
                "rotated into place in VMEM",
            ],
        )
        vm = sum(b.vmem_bytes({}) for b in spec.buffers)
        if vm > 2 * MAX_STEP_BYTES:
            raise LowerError(f"a windowed scan whose windows need {vm / 2**20:.0f} MiB of VMEM")
        return spec, f"{self.stem}({', '.join([*lay.names_in, *lay.wrapper_sizes])})"

    def _layout(self, plan: Plan) -> _Layout:
        """Operands in pallas_call order (scalar prefetch, then HBM: the windows, the carry's init), names
        for every window's refs and buffers, window row counts that change with the configuration as kernel
        parameters the wrapper binds, and the sizes the body may read off the refs (`self.atoms`)."""
        e = self.eqn
        self.widened = {}  # every operand keeps its own shape: windows are copied as they are
        lay = _Layout(prefetch=[*plan.tables, *plan.steps], hbm=[w.pos for w in plan.windows])
        size_params: dict[tuple[int, ...], str] = {}

        def rows_code(eqn: Any) -> str:
            vals = self._rows(eqn)
            if all(x == vals[0] for x in vals):
                return str(vals[0])
            key = tuple(vals)
            if key not in size_params:
                size_params[key] = f"r{len(size_params)}"
                lay.wrapper_sizes.append(self.low.resolve_int(vals, []))
            return size_params[key]

        for pos in [*lay.prefetch, *lay.hbm, plan.carry]:
            v = e.invars[pos]
            if is_literal(v):
                continue
            nm = self.low.name_of(v)
            if nm not in lay.names_in:
                lay.names_in.append(nm)
            lay.locals[pos] = f"op{pos}"
        for pos in lay.prefetch:
            if e.invars[pos].aval.dtype.name != "int32":
                raise LowerError(
                    "a windowed scan's integer table that is not int32 (SMEM holds 32-bit scalars)"
                )
        for k, w in enumerate(plan.windows):
            w.ref, w.buf, w.rows = f"op{w.pos}_ref", f"win{k}_ref", rows_code(w.eqn)
        for k, w in enumerate(plan.reads):
            w.ref, w.buf, w.rows = CARRY_REF, f"cur{k}_ref", rows_code(w.eqn)
        carry = self.body.invars[plan.carry]
        lay.write = Window(plan.write, plan.carry, rows_code(plan.write), _aligned(plan.write, carry), CARRY_REF,
                           "new_ref", carry.aval.dtype.itemsize)  # fmt: skip
        lay.params = list(size_params.values())
        self.atoms = {"kernel": [], "wrapper": []}
        for pos, local in lay.locals.items():
            ref = f"{local}_ref" if pos != plan.carry else CARRY_REF
            for d in range(len(e.invars[pos].aval.shape)):
                vals = [int(a.invars[pos].aval.shape[d]) for a in self.low.traces.aligned_eqns(e)]
                self.atoms["kernel"].append((f"{ref}.shape[{d}]", vals))
        for key, name in size_params.items():
            self.atoms["kernel"].append((name, list(key)))
        return lay

    def _kernel_code(self, plan: Plan, lay: _Layout) -> str:
        tables = {pos: f"op{pos}_ref" for pos in plan.tables}
        steps = {pos: f"op{pos}_ref" for pos in plan.steps}
        rev = bool(self.eqn.params["reverse"])
        lines = ["t_index = pl.program_id(0)", "n_index = pl.num_programs(0)"]
        lines.append("step = n_index - 1 - t_index" if rev else "step = t_index")
        lines.append("nxt = step - 1" if rev else "nxt = step + 1")
        lines += self._emit_scalars(plan, tables, steps)
        lines += ["sc = _scal(step)", "slot = lax.rem(t_index, 2)"]
        lines += self._prefetch_lines(plan)
        lines += [""] + self._body_lines(plan) + self._write_lines(plan, lay)
        refs = [f"{lay.locals[p]}_ref" for p in [*lay.prefetch, *lay.hbm]] + ["init_hbm", CARRY_REF]
        scratch = [w.buf for w in plan.windows] + [w.buf for w in plan.reads] + [lay.write.buf, "sem"]
        params = f", *, {', '.join(lay.params)}" if lay.params else ""
        kernel = [f"def {self.stem}_kernel({', '.join(refs + scratch)}{params}):",
                  '    """One loop iteration per grid step; the carry and the large operands stay in HBM."""']  # fmt: skip
        kernel += [("    " + ln) if ln else "" for ln in lines]
        return "\n".join(kernel) + "\n"

    def _prefetch_lines(self, plan: Plan) -> list[str]:
        """Each window's copy for this iteration (started at the first) and for the next (started now, into
        the other slot), then the wait for this iteration's."""
        if not plan.windows:
            return []
        lines = ["", "def _copies(sc_, slot_):"]
        for w in plan.windows:
            lines += ["    " + ln for ln in self._start_code(w, "sc_", w.rows)]
        copies = [
            self._copy_code(w, w.rows, "slot_", f"sem.at[{2 * k} + slot_]")
            for k, w in enumerate(plan.windows)
        ]
        lines.append(f"    return [{', '.join(copies)}]")
        return lines + [
            "",
            "@pl.when(t_index == 0)",
            "def _first():",
            "    for cp in _copies(sc, slot):",
            "        cp.start()",
            "",
            "@pl.when(t_index + 1 < n_index)",
            "def _prefetch():",
            "    for cp in _copies(_scal(nxt), 1 - slot):",
            "        cp.start()",
            "",
            "for cp in _copies(sc, slot):",
            "    cp.wait()",
        ]

    def _body_lines(self, plan: Plan) -> list[str]:
        """The body's tensor work, its windows' values in place of their `dynamic_slice`s. The carry's rows
        are read as soon as the iteration starts (the last one's write is done) and waited for where the
        body reads them."""
        self.code_of = {v: f"sc[{i}]" for v, i in self.scalar_index.items()}
        self.lines = []
        for k, w in enumerate(plan.reads):
            self.lines += self._start_code(w, "sc", w.rows)
            sem = f"sem.at[{2 * len(plan.windows) + k}]"
            self.lines += [f"cp_{w.buf} = {self._copy_code(w, w.rows, None, sem)}", f"cp_{w.buf}.start()"]
        window_eqns = {w.eqn: w for w in [*plan.windows, *plan.reads]}
        skip = {*plan.scalar_eqns, plan.write}
        for eq in self.body.eqns:
            if eq in skip:
                continue
            w = window_eqns.get(eq)
            if w is None:
                self.emit(eq)
                continue
            out = eq.outvars[0]
            nm = self.fresh("w")
            if w in plan.windows:
                self.lines += self._start_code(w, "sc", w.rows)
                val = f"{w.buf}[slot]"
            else:
                self.lines.append(f"cp_{w.buf}.wait()")
                val = f"{w.buf}[...]"
            if w.aligned:
                a = w.align
                span = f"({w.rows} + {a})"
                self.lines.append(
                    f"{nm} = pltpu.roll({val}.astype(jnp.float32), lax.rem({span} - (s_{w.buf} - a_{w.buf}), "
                    f"{span}), 0)[:{w.rows}].astype({dtype_code(dtype_name(out.aval))})"
                )
            else:
                self.lines.append(f"{nm} = {val}")
            self.code_of[out] = nm
        return self.lines

    def _write_lines(self, plan: Plan, lay: _Layout) -> list[str]:
        """The write: the update's rows replace the carry's; the rest of an aligned window goes back as it
        was read (by this iteration's read of the same rows when there is one)."""
        write = lay.write
        upd = plan.write.invars[1]
        value = self.arg(upd)
        lines = self._start_code(write, "sc", write.rows)
        start = self._scalar_code(plan.write.invars[2], "sc")
        same = next((r for r in plan.reads if r.aligned == write.aligned and r.rows == write.rows
                     and self._scalar_code(r.eqn.invars[1], "sc") == start), None)  # fmt: skip
        n_sem = 2 * len(plan.windows) + len(plan.reads) + 2
        if write.aligned:
            a = write.align
            if same is not None:
                base = f"{same.buf}[...]"
            else:
                copy = self._copy_code(write, write.rows, None, f"sem.at[{n_sem - 2}]")
                lines += [f"cp_base = {copy}", "cp_base.start()", "cp_base.wait()"]
                base = f"{write.buf}[...]"
            off = f"s_{write.buf} - a_{write.buf}"
            lines += [
                f"placed = jnp.concatenate([{value}.astype(jnp.float32), "
                f"jnp.zeros(({a}, *{value}.shape[1:]), jnp.float32)], axis=0)",
                f"placed = pltpu.roll(placed, {off}, 0).astype({dtype_code(dtype_name(upd.aval))})",
                "rows = lax.broadcasted_iota(jnp.int32, placed.shape, 0)",
                f"inside = (rows >= {off}) & (rows < {off} + {write.rows})",
                f"{write.buf}[...] = jnp.where(inside, placed, {base})",
            ]
        else:
            lines.append(f"{write.buf}[...] = {value}.astype({write.buf}.dtype)")
        copy = self._copy_code(write, write.rows, None, f"sem.at[{n_sem - 1}]", True)
        return lines + [f"cp_write = {copy}", "cp_write.start()", "cp_write.wait()"]

    def _wrapper_code(self, plan: Plan, lay: _Layout, length: list[int]) -> str:
        e, body, s, cpos = self.eqn, self.body, self.stem, plan.carry
        n_steps = str(length[0]) if all(x == length[0] for x in length) else self.low.resolve_extent(length)
        init = e.invars[cpos]
        w = [f"def {s}({', '.join([*lay.names_in, *lay.params])}):",
             '    """lax.scan as one Pallas kernel: a sequential grid over the iterations, the carry in HBM, '
             'windows moved by DMA."""']  # fmt: skip
        w += [f"    {local} = {self.low.name_of(e.invars[pos])}" for pos, local in lay.locals.items()]
        if is_literal(init):
            shape = self.shape_code(body.invars[cpos], "wrapper")
            fill = literal_code(init.val, dtype_name(init.aval))
            w.append(
                f"    op{cpos} = jnp.full({shape}, {fill}, {dtype_code(dtype_name(body.invars[cpos].aval))})"
            )
        scratch = []
        for win in plan.windows:
            v = body.invars[win.pos]
            rows = f"{win.rows} + {win.align}" if win.aligned else win.rows
            rest = ", ".join(f"op{win.pos}.shape[{d}]" for d in range(1, len(v.aval.shape)))
            scratch.append(f"pltpu.VMEM((2, {rows}, {rest}), op{win.pos}.dtype)")
        carry = body.invars[cpos]
        crest = ", ".join(f"op{cpos}.shape[{d}]" for d in range(1, len(carry.aval.shape)))
        for win in [*plan.reads, lay.write]:
            rows = f"{win.rows} + {win.align}" if win.aligned else win.rows
            scratch.append(f"pltpu.VMEM(({rows}, {crest}), op{cpos}.dtype)")
        scratch.append(f"pltpu.SemaphoreType.DMA(({2 * len(plan.windows) + len(plan.reads) + 2},))")
        bound = ", ".join(f"{p}={p}" for p in lay.params)
        kfn = f"functools.partial({s}_kernel, {bound})" if lay.params else f"{s}_kernel"
        operands = [lay.locals[p] for p in [*lay.prefetch, *lay.hbm]] + [f"op{cpos}"]
        w += [
            f"    n_steps = {n_steps}",
            "    out = pl.pallas_call(",
            f"        {kfn},",
            "        grid_spec=pltpu.PrefetchScalarGridSpec(",
            f"            num_scalar_prefetch={len(lay.prefetch)},",
            "            grid=(n_steps,),",
            f"            in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * {len(lay.hbm) + 1},",
            "            out_specs=pl.BlockSpec(memory_space=pl.ANY),",
            f"            scratch_shapes=[{', '.join(scratch)}],",
            "        ),",
            f"        out_shape=jax.ShapeDtypeStruct(op{cpos}.shape, op{cpos}.dtype),",
            f"        input_output_aliases={{{len(lay.prefetch) + len(lay.hbm)}: 0}},",
            "        compiler_params=pltpu.CompilerParams(",
            '            dimension_semantics=("arbitrary",),',
            f"            vmem_limit_bytes={self.cprefix}VMEM_LIMIT_BYTES,",
            "        ),",
            "        cost_estimate=pl.CostEstimate(",
            f"            flops={int(self.flop_count)} * n_steps,",
            "            transcendentals=0,",
            f"            bytes_accessed=_nbytes({', '.join(operands)}) * 2,",
            "        ),",
            f"    )({', '.join(operands)})",
            "    return out",
        ]
        return "\n".join(w) + "\n"

    def _window_buffers(self, plan: Plan, write: Window) -> list[BufferSpec]:
        out: list[BufferSpec] = []
        body = self.body

        def rows_of(eqn: Any, aligned: bool, itemsize: int) -> int:
            return self._rows(eqn)[0] + (align_rows(itemsize) if aligned else 0)

        for w in plan.windows:
            v = body.invars[w.pos]
            rows = rows_of(w.eqn, w.aligned, v.aval.dtype.itemsize)
            dims = [DimRef(kind="full", extent=rows)] + [
                DimRef(kind="full", extent=int(x)) for x in v.aval.shape[1:]
            ]
            out.append(BufferSpec(what=f"op{w.pos} window (two slots)", dims=dims, itemsize=v.aval.dtype.itemsize,
                                  copies=2, kind="scratch", hbm_bytes=nbytes(self.eqn.invars[w.pos])))  # fmt: skip
            if w.aligned:  # the rotation's float32 copy
                out.append(BufferSpec(what=f"op{w.pos} window in float32", dims=dims, itemsize=4, copies=1,
                                      kind="temporary"))  # fmt: skip
        cv = body.invars[plan.carry]
        for w in [*plan.reads, write]:
            rows = rows_of(w.eqn, w.aligned, cv.aval.dtype.itemsize)
            dims = [DimRef(kind="full", extent=rows)] + [
                DimRef(kind="full", extent=int(x)) for x in cv.aval.shape[1:]
            ]
            out.append(BufferSpec(what=f"{w.buf} (carry rows)", dims=dims, itemsize=cv.aval.dtype.itemsize, copies=1,
                                  kind="scratch"))  # fmt: skip
            out.append(
                BufferSpec(what=f"{w.buf} in float32", dims=dims, itemsize=4, copies=1, kind="temporary")
            )
        return out
