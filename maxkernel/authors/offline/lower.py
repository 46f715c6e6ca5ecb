"""From a partitioned jaxpr to a `ProgramSpec`: kernels, the glue between them, and `computation`.

`computation` mirrors the reference: layout glue (reshapes, slices, gathers) is re-emitted as `jnp`/`lax`
calls with every size derived from the inputs' shapes or the static arguments (`Resolver`), and each
region becomes one call of its kernel wrapper. Nothing in it hard-codes a configuration's shapes.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import numpy as np

from maxkernel.authors.offline.dataflow import Graph, is_literal
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
from maxkernel.authors.offline.families import builder_for
from maxkernel.authors.offline.kernels import LowerError
from maxkernel.authors.offline.partition import FUSION_LEVELS, Options, Partition, Region
from maxkernel.authors.offline.spec import KernelSpec, ProgramSpec
from maxkernel.authors.offline.trace import Atom, Resolver, Traces, Unsupported, _close, search

_OFFSET_FORM = re.compile(r" [-+] \d+$")
"""A grammar expression of the form `dim - k` / `dim + k` (see `trace._candidates`)."""
MAX_CONSTANT_ELEMS = 4096
"""The largest captured constant written into a module as a literal (4096 floats: ~40 KB of text)."""


class Lowering:
    def __init__(self, traces: Traces, options: Options | None = None) -> None:
        self.traces = traces
        self.options = options or Options()
        self.g = Graph(traces)
        self.g.check_supported()
        self.part = Partition(self.g, self.options)
        self.part.run()
        self.resolver = Resolver(traces)
        self.names: dict[Any, str] = {}
        for v, n in zip(self.g.invars, traces.arg_names, strict=False):
            self.names[v] = n
        self._scalar_names: dict[str, str] = {}
        self._tmp = 0

    # --- names ----------------------------------------------------------------------------------------
    def name_of(self, var: Any) -> str:
        if var not in self.names:
            self._tmp += 1
            self.names[var] = f"t{self._tmp}"
        return self.names[var]

    def scalar_name(self, expr: str) -> str:
        if expr.isidentifier():
            return expr
        if expr not in self._scalar_names:
            self._scalar_names[expr] = f"c{len(self._scalar_names)}"
        return self._scalar_names[expr]

    # --- numbers that depend on the configuration -----------------------------------------------------
    def resolve_scalar(
        self, values: list[Any], dtype: str, local: list[Atom] | None = None
    ) -> tuple[str, str] | None:
        """A literal that differs between configurations (or equals a static argument), as (code, scope):
        scope "computation" for expressions over the arguments, "local" for ones over `local` atoms
        (a kernel wrapper's extents). None for a plain constant."""
        if dtype == "bool" or not dtype or dtype.startswith("key"):
            return None
        vals = [float(v) for v in values]
        for a in self.resolver.atoms:
            if not a.is_dim and all(_close(x, y) for x, y in zip(a.values, vals, strict=True)):
                if not is_float(dtype) and any(x != int(x) for x in a.values):
                    continue
                return a.code, "computation"
        if all(_close(v, vals[0]) for v in vals):
            return None
        if local:
            code = search(vals, not is_float(dtype), local)
            if code is not None:
                return code, "local"
        code = self.resolver.resolve(vals, integer=not is_float(dtype))
        return None if code is None else (code, "computation")

    def resolve_extent(self, values: list[int]) -> str:
        if all(v == values[0] for v in values):
            return str(values[0])
        code = self.resolver.resolve([float(v) for v in values], integer=True)
        if code is None:
            return str(values[0])
        return code

    def resolve_int(self, values: list[int], local: list[Atom], prefer: int | None = None) -> str:
        """An integer in a glue op: a static argument, else an operand's own dim (dim `prefer` first), then
        a constant, then the grammar."""
        if all(v == values[0] for v in values) and int(values[0]) <= 1:
            return str(int(values[0]))
        for a in self.resolver.atoms:
            if a.code in self.resolver.int_statics and all(
                float(x) == float(y) for x, y in zip(a.values, values, strict=True)
            ):
                return a.code
        if prefer is not None:
            local = sorted(local, key=lambda a: not a.code.endswith(f".shape[{prefer}]"))
        for a in local:
            if all(int(x) == int(y) for x, y in zip(a.values, values, strict=True)):
                return a.code
        if all(v == values[0] for v in values):
            return str(int(values[0]))
        code = search([float(v) for v in values], True, local)
        if code is not None and _OFFSET_FORM.search(code):
            # `dim - k` fits any two configurations whose values sit k below a dim; when a whole number of
            # windows of another operand's dim fits too (a crop to non-overlapping patches), that is the
            # one that holds at other shapes: 72 and 232 cropped to 64 and 224 are "- 8" only by chance.
            try:
                windows = self.resolver.resolve([float(v) for v in values], integer=True)
            except Unsupported:
                windows = None
            if windows is not None and "//" in windows:
                return windows
        if code is not None:
            return code
        code = self.resolver.resolve([float(v) for v in values], integer=True)
        return str(int(values[0])) if code is None else code

    def local_atoms(self, e: Any) -> list[Atom]:
        atoms = []
        for v in e.invars:
            if is_literal(v):
                continue
            shapes = self.traces.shapes(v)
            for d in range(len(v.aval.shape)):
                atoms.append(Atom(f"{self.name_of(v)}.shape[{d}]", tuple(float(s[d]) for s in shapes), True))
        return atoms

    # --- glue ----------------------------------------------------------------------------------------
    def glue_code(self, i: int) -> str:
        e = self.g.eqns[i]
        name = e.primitive.name
        p = e.params
        local = self.local_atoms(e)
        aligned = self.traces.aligned_eqns(e)

        def arg(k: int) -> str:
            v = e.invars[k]
            if is_literal(v):
                dt = dtype_name(v.aval)
                found = self.resolve_scalar([a.invars[k].val for a in aligned], dt, local)
                if found is not None:
                    return f"jnp.asarray({found[0]}, {dtype_code(dt)})"
                return f"jnp.asarray({literal_code(v.val, dt)}, {dtype_code(dt)})"
            return self.name_of(v)

        def ints(key: str) -> list[list[int]]:
            return [list(a.params[key]) for a in aligned]

        def resolve_list(key: str) -> list[str]:
            per = ints(key)
            return [self.resolve_int([row[j] for row in per], local, j) for j in range(len(per[0]))]

        x = arg(0) if e.invars else ""
        out_dt = dtype_name(e.outvars[0].aval) if hasattr(e.outvars[0].aval, "dtype") else ""
        if self.g.kind[i] == "elementwise":
            args = [arg(k) for k in range(len(e.invars))]
            in_dts = [dtype_name(v.aval) for v in e.invars]
            return elementwise_expr(e, args, out_dt, in_dts, len(e.outvars[0].aval.shape) == 0)
        if name == "random_seed":
            impl = str(p.get("impl", ""))
            return f"jax.random.key({x})" if "fry" in impl else f"jax.random.key({x}, impl={impl!r})"
        if name == "random_wrap":
            return f"jax.random.wrap_key_data({x})"
        if name == "random_unwrap":
            return f"jax.random.key_data({x})"
        if name == "random_bits":
            shapes = [a.params["shape"] for a in aligned]
            dims = [self.resolve_int([s[j] for s in shapes], local) for j in range(len(shapes[0]))]
            return f"jax.random.bits({x}, {_tup(dims) if dims else '()'}, jnp.uint{p['bit_width']})"
        if name == "random_fold_in":
            return f"jax.random.fold_in({x}, {arg(1)})"
        if name == "random_split":
            shapes = [a.params["shape"] for a in aligned]
            dims = [self.resolve_int([s[j] for s in shapes], local) for j in range(len(shapes[0]))]
            return f"jax.random.split({x}, {_tup(dims)})"
        if name == "bitcast_convert_type":
            return f"lax.bitcast_convert_type({x}, {dtype_code(out_dt)})"
        if name == "reshape":
            if p.get("dimensions") is not None:
                raise Unsupported("a reshape with a dimension permutation")
            if is_literal(e.invars[0]):  # a scalar constant given a shape (jnp.repeat's zeros(1))
                sizes = [
                    self.resolve_int(list(d), local)
                    for d in zip(*self.traces.shapes(e.outvars[0]), strict=True)
                ]
                return f"{x}.reshape({_tup(sizes) if sizes else '()'})"
            return f"{x}.reshape({self._reshape_sizes(e, local)})"
        if name == "broadcast_in_dim":
            out_shapes = self.traces.shapes(e.outvars[0])
            in_shapes = self.traces.shapes(e.invars[0]) if not is_literal(e.invars[0]) else None
            bd = list(p["broadcast_dimensions"])
            dims = []
            for j in range(len(out_shapes[0])):
                vals = [s[j] for s in out_shapes]
                if j in bd and in_shapes is not None:
                    src = bd.index(j)
                    if all(a[src] == b for a, b in zip(in_shapes, vals, strict=True)):
                        dims.append(f"{x}.shape[{src}]")
                        continue
                dims.append(self.resolve_int(vals, local))
            return f"lax.broadcast_in_dim({x}, {_tup(dims)}, {int_tuple(bd)})"
        if name == "transpose":
            return f"jnp.transpose({x}, {int_tuple(p['permutation'])})"
        if name == "convert_element_type":
            return f"{x}.astype({dtype_code(dtype_name(e.outvars[0].aval))})"
        if name == "squeeze":
            return f"lax.squeeze({x}, {int_tuple(p['dimensions'])})"
        if name == "expand_dims":
            return f"lax.expand_dims({x}, {int_tuple(p['dimensions'])})"
        if name in ("copy", "copy_p"):
            return x
        if name == "iota":
            shapes = [a.params["shape"] for a in aligned]
            dims = [self.resolve_int([s[j] for s in shapes], local) for j in range(len(shapes[0]))]
            return f"lax.broadcasted_iota({dtype_code(dtype_name(e.outvars[0].aval))}, {_tup(dims)}, {p['dimension']})"
        if name == "slice":
            starts = resolve_list("start_indices")
            limits = resolve_list("limit_indices")
            strides = p.get("strides")
            tail = f", {int_tuple(strides)}" if strides is not None and any(s != 1 for s in strides) else ""
            return f"lax.slice({x}, {_tup(starts)}, {_tup(limits)}{tail})"
        if name == "concatenate":
            xs = ", ".join(arg(k) for k in range(len(e.invars)))
            return f"lax.concatenate([{xs}], {p['dimension']})"
        if name == "pad":
            per = [list(a.params["padding_config"]) for a in aligned]
            cfg = []
            for j in range(len(per[0])):
                lo = self.resolve_int([row[j][0] for row in per], local)
                hi = self.resolve_int([row[j][1] for row in per], local)
                it = self.resolve_int([row[j][2] for row in per], local)
                cfg.append(f"({lo}, {hi}, {it})")
            return f"lax.pad({x}, {arg(1)}, [{', '.join(cfg)}])"
        if name == "rev":
            return f"lax.rev({x}, {int_tuple(p['dimensions'])})"
        if name == "dynamic_slice":
            idx = ", ".join(arg(k) for k in range(1, len(e.invars)))
            sizes = resolve_list("slice_sizes")
            return f"lax.dynamic_slice({x}, [{idx}], {_tup(sizes)})"
        if name == "dynamic_update_slice":
            idx = ", ".join(arg(k) for k in range(2, len(e.invars)))
            return f"lax.dynamic_update_slice({x}, {arg(1)}, [{idx}])"
        if name == "gather":
            dn = p["dimension_numbers"]
            sizes = []
            per = ints("slice_sizes")
            op_shapes = self.traces.shapes(e.invars[0])
            for j in range(len(per[0])):
                vals = [row[j] for row in per]
                if all(s[j] == v for s, v in zip(op_shapes, vals, strict=True)) and vals[0] != 1:
                    sizes.append(f"{x}.shape[{j}]")
                else:
                    sizes.append(self.resolve_int(vals, local))
            mode = p.get("mode")
            mode_code = f"lax.GatherScatterMode.{getattr(mode, 'name', str(mode).split('.')[-1])}"
            fill = p.get("fill_value")
            dnc = (
                "lax.GatherDimensionNumbers("
                f"offset_dims={int_tuple(dn.offset_dims)}, collapsed_slice_dims={int_tuple(dn.collapsed_slice_dims)}, "
                f"start_index_map={int_tuple(dn.start_index_map)}, "
                f"operand_batching_dims={int_tuple(getattr(dn, 'operand_batching_dims', ()))}, "
                f"start_indices_batching_dims={int_tuple(getattr(dn, 'start_indices_batching_dims', ()))})"
            )
            src = self.cast_source(e.invars[0])
            cast = ""
            if src is not None:  # gather the few values first, then cast them (never the whole array)
                x, cast = self.name_of(src), f".astype({dtype_code(dtype_name(e.outvars[0].aval))})"
            return (
                f"lax.gather({x}, {arg(1)}, {dnc}, {_tup(sizes)}, "
                f"indices_are_sorted={bool(p.get('indices_are_sorted'))}, unique_indices={bool(p.get('unique_indices'))}, "
                f"mode={mode_code}, fill_value={'None' if fill is None else literal_code(fill, dtype_name(e.outvars[0].aval))})"
                + cast
            )
        if name in ("scatter", "scatter-add", "scatter_add"):
            dn = p["dimension_numbers"]
            mode = p.get("mode")
            mode_code = f"lax.GatherScatterMode.{getattr(mode, 'name', str(mode).split('.')[-1])}"
            dnc = (
                "lax.ScatterDimensionNumbers("
                f"update_window_dims={int_tuple(dn.update_window_dims)}, "
                f"inserted_window_dims={int_tuple(dn.inserted_window_dims)}, "
                f"scatter_dims_to_operand_dims={int_tuple(dn.scatter_dims_to_operand_dims)}, "
                f"operand_batching_dims={int_tuple(getattr(dn, 'operand_batching_dims', ()))}, "
                f"scatter_indices_batching_dims={int_tuple(getattr(dn, 'scatter_indices_batching_dims', ()))})"
            )
            fn = "lax.scatter" if name == "scatter" else "lax.scatter_add"
            return (
                f"{fn}({x}, {arg(1)}, {arg(2)}, {dnc}, indices_are_sorted={bool(p.get('indices_are_sorted'))}, "
                f"unique_indices={bool(p.get('unique_indices'))}, mode={mode_code})"
            )
        if name == "split":
            per = ints("sizes")
            sizes = [self.resolve_int([row[j] for row in per], local) for j in range(len(per[0]))]
            return f"lax.split({x}, {_tup(sizes)}, axis={p['axis']})"
        raise Unsupported(f"the layout op `{name}` has no glue emitter")

    def _reshape_sizes(self, e: Any, local: list[Atom]) -> str:
        x = e.invars[0]
        out_shapes = self.traces.shapes(e.outvars[0])
        in_shapes = self.traces.shapes(x)
        n_out, n_in = len(out_shapes[0]), len(in_shapes[0])
        xn = self.name_of(x)
        pre = 0
        while pre < min(n_out, n_in) and all(
            a[pre] == b[pre] for a, b in zip(in_shapes, out_shapes, strict=True)
        ):
            pre += 1
        suf = 0
        while suf < min(n_out, n_in) - pre and all(
            a[n_in - 1 - suf] == b[n_out - 1 - suf] for a, b in zip(in_shapes, out_shapes, strict=True)
        ):
            suf += 1
        dims: list[str | None] = []
        for j in range(n_out):
            if j < pre:
                dims.append(f"{xn}.shape[{j}]")
            elif j >= n_out - suf:
                dims.append(f"{xn}.shape[{n_in - (n_out - j)}]")
            else:
                vals = [s[j] for s in out_shapes]
                code = None
                for a in local:
                    if all(int(u) == int(w) for u, w in zip(a.values, vals, strict=True)):
                        code = a.code
                        break
                if code is None and all(v == 1 for v in vals):
                    code = "1"
                if code is None:
                    try:
                        code = self.resolver.resolve([float(v) for v in vals], integer=True)
                    except Unsupported:
                        code = None
                    if code is None and all(v == vals[0] for v in vals):
                        code = str(vals[0])
                dims.append(code)
        middle = [j for j in range(pre, n_out - suf)]
        unknown = [j for j in middle if dims[j] is None]
        if len(unknown) > 1:
            raise Unsupported("a reshape whose new sizes cannot be derived from the input shapes")
        if not unknown:
            cand = [j for j in middle if dims[j] != "1"]
            if cand:
                dims[cand[-1]] = "-1"
        else:
            dims[unknown[0]] = "-1"
        out = [d if d is not None else "-1" for d in dims]
        return ", ".join(out) if len(out) != 1 else out[0] + ","

    # --- the program ----------------------------------------------------------------------------------
    def cast_source(self, var: Any) -> Any | None:
        """For a glue float-to-float cast: the value it casts (a gather may read that and cast after)."""
        p = self.g.producer.get(var)
        if p is None or self.part.status[p] != "glue":
            return None
        e = self.g.eqns[p]
        if e.primitive.name != "convert_element_type" or is_literal(e.invars[0]):
            return None
        if not (is_float(dtype_name(e.invars[0].aval)) and is_float(dtype_name(var.aval))):
            return None
        return e.invars[0]

    def cast_needed(self, i: int) -> bool:
        """Is glue cast `i` read by anything but gathers that read its source instead (see glue_code)?"""
        e = self.g.eqns[i]
        v = e.outvars[0]
        if self.cast_source(v) is None or v in self.g.out_set:
            return True
        for c in self.g.consumers.get(v, []):
            ce = self.g.eqns[c]
            if self.part.status[c] == "glue" and ce.primitive.name == "gather" and ce.invars[0] is v:
                continue
            if self.part.status[c] == "glue":
                return True
        return any(v in self.part.region_inputs(r) for r in self.part.regions.values())

    def constant_lines(self) -> list[str]:
        """Arrays the reference captured (a `np.array` or `np.float32(...)` held in a closure or a module
        global) are constvars of the jaxpr, read by kernels and glue under a generated name; each is
        written into `computation` as a literal. Only small ones, and only when every traced configuration
        captured the same value: a constant built from the input shapes (`np.tril(np.ones((n, n)))`) has
        no single literal, and a big one belongs in the inputs, not in the module's text."""
        lines: list[str] = []
        for k, var in enumerate(self.g.constvars):
            if var not in self.names:  # no emitted kernel call, glue line or return reads it
                continue
            values = [np.asarray(t.consts[k]) for t in self.traces.all]
            first = values[0]
            what = f"a constant array {_aval(var)} captured by the reference"
            if any(
                v.shape != first.shape or not np.array_equal(v, first, equal_nan=True) for v in values[1:]
            ):
                raise Unsupported(f"{what} differs between input configurations (build it from iota instead)")
            if first.size > MAX_CONSTANT_ELEMS:
                raise Unsupported(
                    f"{what} has {first.size} elements; constants are written into the module only up to "
                    f"{MAX_CONSTANT_ELEMS} (pass it as an input)"
                )
            dt = dtype_name(var.aval)
            try:
                items = [literal_code(x, dt) for x in first.reshape(-1)]
                code = dtype_code(dt)
            except EmitError as exc:
                raise Unsupported(f"{what}: {exc}") from exc
            flat = f"jnp.array([{', '.join(items)}], {code})"
            shape = tuple(int(d) for d in first.shape)
            expr = flat if len(shape) == 1 else f"{flat}.reshape({shape})"
            lines.append(f"{self.name_of(var)} = {expr}  # {_aval(var)}, a constant of the reference")
        return lines

    def order(self) -> list[tuple[str, Any]]:
        """Glue equations and regions in an order that respects every dependency (Kahn, by position)."""
        g, part = self.g, self.part
        nodes: list[tuple[str, Any]] = []
        node_of_var: dict[Any, int] = {}
        for i, e in enumerate(g.eqns):
            if part.status[i] == "glue":
                nodes.append(("glue", i))
                for v in e.outvars:
                    node_of_var[v] = len(nodes) - 1
        for r in part.regions.values():
            nodes.append(("region", r))
            for v in part.region_outputs(r):
                node_of_var[v] = len(nodes) - 1
        deps: dict[int, set[int]] = defaultdict(set)
        for k, (kind, obj) in enumerate(nodes):
            ins = g.eqns[obj].invars if kind == "glue" else part.region_inputs(obj)
            for v in ins:
                if is_literal(v):
                    continue
                if v in node_of_var:
                    deps[k].add(node_of_var[v])
                elif v in g.producer and part.status[g.producer[v]] == "float":
                    raise LowerError(
                        "a value is needed outside kernels but never written (the "
                        f"`{g.eqns[g.producer[v]].primitive.name}` -> {v.aval.str_short()} a {kind} reads)"
                    )
        pos = {k: (obj if kind == "glue" else max(obj.owned)) for k, (kind, obj) in enumerate(nodes)}
        done: list[int] = []
        left = set(range(len(nodes)))
        while left:
            ready = [k for k in left if deps[k] <= set(done)]
            if not ready:
                raise LowerError("kernels and glue depend on each other in a cycle")
            k = min(ready, key=lambda k: pos[k])
            done.append(k)
            left.remove(k)
        return [nodes[k] for k in done]

    def run(self, task_id: str = "") -> ProgramSpec:
        g, part = self.g, self.part
        regions = list(part.regions.values())
        if not regions:
            raise Unsupported("the reference has no arithmetic to put in a kernel (it only moves data)")
        ordered = self.order()
        n_k = sum(1 for k, _ in ordered if k == "region")
        kernels: list[KernelSpec] = []
        body: list[str] = []
        glue_desc: list[str] = []
        glue_lines: set[int] = set()  # indices into body
        counter = 0
        for kind, obj in ordered:
            if kind == "glue":
                e = g.eqns[obj]
                if not self.cast_needed(obj):
                    continue
                try:
                    expr = self.glue_code(obj)
                except EmitError as exc:
                    raise Unsupported(str(exc)) from exc
                outs = [self.name_of(v) for v in e.outvars]
                lhs = ", ".join(outs) if len(outs) > 1 else outs[0]
                body.append(f"{lhs} = {expr}  # {_aval(e.outvars[0])}")
                glue_desc.append(e.primitive.name)
                glue_lines.add(len(body) - 1)
                continue
            region: Region = obj
            builder = builder_for(region.kind)(self, region, counter, n_k)
            counter += 1
            spec, call = builder.build()
            kernels.append(spec)
            outs = builder.outputs
            lhs = ", ".join(self.name_of(v) for v in outs)
            body.append(f"{lhs} = {call}  # {', '.join(_aval(v) for v in outs)}")
        rets = []
        for v in g.outvars:
            if is_literal(v):
                rets.append(literal_code(v.val, dtype_name(v.aval)))
            else:
                rets.append(self.name_of(v))
        body, glue_desc = _drop_dead_glue(body, glue_lines, glue_desc, rets)
        body = self.constant_lines() + body  # after the rest: only the constants some code reads
        sig = ", ".join(self.traces.arg_names)
        comp = [f"def computation({sig}):"]
        comp.append(f'    """{self._comp_doc(kernels)}"""')
        comp += ["    " + line for line in body]
        comp.append(f"    return {rets[0] if len(rets) == 1 else '(' + ', '.join(rets) + ',)'}")
        main = max(kernels, key=lambda k: k.flops)
        family = main.family
        summary = self._summary(kernels)
        if "conv_general_dilated" in self.traces.rewritten:
            summary = "convolution as im2col patches (XLA slices) times reshaped weights; " + summary
            if family.startswith("matmul") or family == "gated_matmul":
                family = "conv_" + family
        return ProgramSpec(
            task_id=task_id,
            family=family,
            summary=summary,
            arg_names=list(self.traces.arg_names),
            n_dynamic=self.traces.n_dynamic,
            computation_code="\n".join(comp) + "\n",
            kernels=kernels,
            ops=self._ops(),
            inputs=[_aval(v) for v in g.invars],
            outputs=[_aval(v) if not is_literal(v) else "literal" for v in g.outvars],
            glue=sorted(set(glue_desc)),
            options={
                "attention": self.options.attention,
                "multi_dot": self.options.multi_dot,
                "epilogue_reductions": self.options.epilogue_reductions,
                "paged": self.options.paged,
            },
        )

    def _comp_doc(self, kernels: list[KernelSpec]) -> str:
        if len(kernels) == 1:
            return (
                f"Same signature as the reference; the work runs in {kernels[0].name} ({kernels[0].family})."
            )
        names = ", ".join(k.name for k in kernels)
        return f"Same signature as the reference; the work runs in {len(kernels)} Pallas kernels: {names}."

    def _summary(self, kernels: list[KernelSpec]) -> str:
        if len(kernels) == 1:
            return kernels[0].title
        return "; then ".join(f"{k.title}" for k in kernels)

    def _ops(self) -> list[str]:
        out = []
        for e, k in zip(self.g.eqns, self.g.kind, strict=True):
            if k in ("absorbed",) and e.primitive.name not in ("iota",):
                continue
            out.append(f"{e.primitive.name} -> {_aval(e.outvars[0])}")
        return out


_NAME = re.compile(r"[A-Za-z_]\w*")


def _drop_dead_glue(
    body: list[str], glue_lines: set[int], glue_desc: list[str], rets: list[str]
) -> tuple[list[str], list[str]]:
    """Drop glue whose results nothing reads: a kernel that reads a gather's source itself (paged K/V)
    leaves the gather unused, and an unused gather is still an HBM copy in the program the estimate and
    the reader see. Returns the kept lines and the primitive names of the glue kept."""
    live = set(rets)
    keep = [True] * len(body)
    for k in range(len(body) - 1, -1, -1):
        code = body[k].split("  # ", 1)[0]
        lhs, _, rhs = code.partition(" = ")
        defs = {n.strip() for n in lhs.split(",")}
        if k in glue_lines and not defs & live:
            keep[k] = False
            continue
        live |= set(_NAME.findall(rhs))
    kept_glue = [d for k, d in zip(sorted(glue_lines), glue_desc, strict=True) if keep[k]]
    return [line for k, line in enumerate(body) if keep[k]], kept_glue


def _aval(v: Any) -> str:
    return shape_comment(dtype_name(v.aval), [str(s) for s in v.aval.shape])


def _tup(items: list[str]) -> str:
    if len(items) == 1:
        return f"({items[0]},)"
    return f"({', '.join(items)})"


def lower_program(traces: Traces, task_id: str = "", options: Options | None = None) -> ProgramSpec:
    """Partition and lower, falling back to less fusion when a fused region does not fit its template."""
    start = options or FUSION_LEVELS[0]
    ladder = [start] + [o for o in FUSION_LEVELS if _less_fused(o, start) and o != start]
    last: Exception | None = None
    for opt in ladder:
        try:
            return Lowering(traces, opt).run(task_id)
        except LowerError as exc:
            last = exc
            continue
    raise Unsupported(f"no kernel template fits: {last}")


def _less_fused(a: Options, b: Options) -> bool:
    return all(
        getattr(a, f) <= getattr(b, f) for f in ("attention", "multi_dot", "epilogue_reductions", "paged")
    )
