"""Write a flattened traced program (`program.Program`) back out as a readable, standalone JAX function.

One line per operation, in the program's order, with the array's shape and dtype at the task's own scale
as a comment, and the line of the user's code it came from whenever that changes. Operations are written
with the public API that traces back to the same primitive (`lax.conv_general_dilated`, `jnp.exp`,
`x.reshape(...)`), so the written function's jaxpr is the traced one: what the offline author reads is
what PyTorch computed. Sizes that follow the inputs are written as expressions of shapes (`shape_fit`).

A primitive with no entry in `WRITERS` is refused by name (`UnsupportedPrimitive`); adding one is one
function and one table row.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from maxkernel.convert.program import Op, Program, Ref
from maxkernel.convert.shape_fit import SizeFitter


class UnsupportedPrimitive(Exception):
    """A primitive (or a parameter of one) the writer does not take; `primitive` names it."""

    def __init__(self, primitive: str, detail: str, origin: str = "") -> None:
        super().__init__(f"{primitive}: {detail}")
        self.primitive, self.detail, self.origin = primitive, detail, origin


class SizeNotFitted(Exception):
    """A size differs between the two scales and is no simple function of any shape in scope."""


def dtype_code(dtype: str) -> str:
    return f"jnp.{np.dtype(dtype).name}" if dtype != "bfloat16" else "jnp.bfloat16"


def _float_text(value: float, dtype: str) -> str:
    if math.isnan(value):
        return "jnp.nan"
    if math.isinf(value):
        return "jnp.inf" if value > 0 else "-jnp.inf"
    text = str(np.asarray(value, dtype=np.float32 if dtype in ("float32", "") else np.float64).item())
    if dtype == "float32":
        text = repr(float(np.float32(value)))
        short = str(np.float32(value))
        if float(np.float32(float(short))) == float(np.float32(value)):
            text = short
    if not any(c in text for c in ".eEn"):
        text += ".0"
    return text


PREFIX = {
    "conv_general_dilated": "conv",
    "dot_general": "dot",
    "reduce_sum": "total",
    "reduce_max": "peak",
    "reduce_min": "low",
    "reduce_window_max": "pool",
    "reduce_window_sum": "pool",
    "reduce_window": "pool",
    "broadcast_in_dim": "b",
    "reshape": "r",
    "transpose": "t",
    "scan": "scan",
}


class SourceWriter:
    """Writes one function from the same program traced at several scales, the task's own first: sizes
    that differ between the traces become shape expressions; one trace means every size is a literal."""

    def __init__(self, programs: list[Program]) -> None:
        self.programs = programs
        self.own = programs[0]
        self.fitter = SizeFitter()
        self.counter = 0
        self.lines: list[str] = []
        self.indent = "    "
        self.last_origin = ""
        self.operand_names: list[str] = []

    # --- names and values ------------------------------------------------------------------------------
    def fresh(self, prim: str) -> str:
        self.counter += 1
        return f"{PREFIX.get(prim, 'v')}{self.counter}"

    def literal(self, refs: list[Ref]) -> str:
        a = refs[0]
        if isinstance(a.value, np.ndarray) and a.value.ndim > 0:
            return f"jnp.asarray({a.value.tolist()!r}, {dtype_code(a.dtype)})"
        values = [r.value for r in refs]
        if len(set(map(repr, values))) > 1:
            fitted = self.fitter.fit_number([float(v) for v in values], self.operand_names)
            if fitted is None:
                raise SizeNotFitted(f"a constant that follows the sizes: {values[0]} at the task's scale")
            # a jnp scalar, not a Python number: arithmetic on it must be staged as in the traced program
            return f"{dtype_code(a.dtype or 'float32')}({fitted})"
        value = a.value
        if a.dtype == "bool" or isinstance(value, bool | np.bool_):
            return "True" if value else "False"
        if a.dtype.startswith(("int", "uint")):
            return str(int(value))
        text = _float_text(float(value), a.dtype)
        if not a.weak and a.dtype not in ("float32", ""):
            return f"{dtype_code(a.dtype)}({text})"
        return text

    def size(self, values: list[Any]) -> str:
        """A size parameter (an int, or nested tuples of ints): a literal where every scale agrees."""
        own = values[0]
        if isinstance(own, bool) or own is None:
            return repr(own)
        if isinstance(own, int | np.integer):
            code = self.fitter.fit([int(v) for v in values], self.operand_names)
            if code is None:
                raise SizeNotFitted(f"a size that follows the inputs: {own} at the task's scale")
            return code
        if isinstance(own, tuple | list):
            parts = [self.size([v[i] for v in values]) for i in range(len(own))]
            return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
        return repr(own)

    # --- writing ---------------------------------------------------------------------------------------
    def emit(self, text: str) -> None:
        self.lines.append(self.indent + text)

    def write_function(self, name: str, arg_names: list[str], docstring: str = "") -> str:
        """The whole `def name(args):` with its body; outputs returned as one array or a tuple."""
        self.lines = [f"def {name}({', '.join(arg_names)}):"]
        if docstring:
            self.emit(f'"""{docstring}"""')
        env = dict(zip(self.own.invars, arg_names, strict=True))
        for i, arg in enumerate(arg_names):
            self.fitter.add(arg, [p.avals[p.invars[i]][0] for p in self.programs])
        outs = self.body(self.programs, env)
        self.emit(f"return {outs[0]}" if len(outs) == 1 else f"return {', '.join(outs)}")
        return "\n".join(self.lines) + "\n"

    def body(self, programs: list[Program], env: dict[int, str]) -> list[str]:
        """Write the programs' operations (one program, several scales); `env` names the inputs of the
        first. Returns the codes of its outputs."""
        own = programs[0]
        for vid, value in own.consts.items():
            if value.size > 64:
                raise UnsupportedPrimitive(
                    "captured constant",
                    f"the trace captured a {value.dtype}{list(value.shape)} tensor that is neither an input "
                    "nor a parameter",
                )
            env[vid] = f"jnp.asarray({value.tolist()!r}, {dtype_code(str(value.dtype))})"
        for ops in zip(*(p.ops for p in programs), strict=True):
            self.write_op(list(ops), programs, env)
        return [self.ref([p.outs[i] for p in programs], env) for i in range(len(own.outs))]

    def ref(self, refs: list[Ref], env: dict[int, str]) -> str:
        return self.literal(refs) if refs[0].is_literal else env[refs[0].var]

    def write_op(self, ops: list[Op], programs: list[Program], env: dict[int, str]) -> None:
        a = ops[0]
        writer = WRITERS.get(a.prim)
        if writer is None:
            raise UnsupportedPrimitive(a.prim, "no JAX source writer for this primitive", a.origin)
        if a.origin and a.origin != self.last_origin:
            self.emit(f"# {a.origin}")
            self.last_origin = a.origin
        self.operand_names = [env[r.var] for r in a.ins if r.var is not None]
        args = [self.ref([op.ins[i] for op in ops], env) for i in range(len(a.ins))]
        if a.ins and all(r.is_literal for r in a.ins) and not args[0].startswith("jnp."):
            # Python would fold an operation on literals away; the traced program has it
            args[0] = f"{dtype_code(a.ins[0].dtype or 'float32')}({args[0]})"
        ctx = OpContext(self, ops, args, env, programs)
        names = [self.fresh(a.prim) if o is not None else "_" for o in a.outs]
        code = writer(ctx)
        if a.prim == "scan":  # lax.scan returns (carry, stacked outputs)
            n_carry = a.params["num_carry"]
            target = f"{_tuple(names[:n_carry])}, {_tuple(names[n_carry:])}"
        else:
            target = names[0] if len(names) == 1 else ", ".join(names)
        own = programs[0]
        shapes = [own.avals[o] for o in a.outs if o is not None]
        comment = "  # " + ", ".join(f"{dt}{list(sh)}" for sh, dt in shapes) if shapes else ""
        self.emit(f"{target} = {code}{comment}")
        for i, name in enumerate(names):
            if a.outs[i] is not None:
                env[a.outs[i]] = name
                self.fitter.add(name, [p.avals[op.outs[i]][0] for p, op in zip(programs, ops, strict=True)])


@dataclasses.dataclass
class OpContext:
    writer: SourceWriter
    ops: list[Op]
    """The operation at each traced scale, the task's own first."""
    args: list[str]
    env: dict[int, str]
    programs: list[Program]

    @property
    def a(self) -> Op:
        return self.ops[0]

    @property
    def own(self) -> Program:
        return self.programs[0]

    def p(self, key: str) -> Any:
        return self.a.params[key]

    def size(self, key: str) -> str:
        return self.writer.size([op.params[key] for op in self.ops])

    def in_dtype(self, i: int = 0) -> str:
        r = self.a.ins[i]
        return r.dtype if r.is_literal else self.own.avals[r.var][1]

    def out_dtype(self, i: int = 0) -> str:
        o = self.a.outs[i]
        return self.own.avals[o][1] if o is not None else ""


# --- writers, one per primitive ----------------------------------------------------------------------------

Writer = Callable[[OpContext], str]

BINARY_OPERATORS = {"add": "+", "sub": "-", "mul": "*", "gt": ">", "ge": ">=", "lt": "<", "le": "<=",
                    "eq": "==", "ne": "!=", "and": "&", "or": "|", "xor": "^"}  # fmt: skip
FLOAT_ONLY_OPERATORS = {"div": "/", "pow": "**"}
BINARY_FUNCTIONS = {"max": "jnp.maximum", "min": "jnp.minimum", "atan2": "jnp.arctan2", "rem": "lax.rem",
                    "nextafter": "lax.nextafter", "shift_left": "lax.shift_left",
                    "shift_right_logical": "lax.shift_right_logical",
                    "shift_right_arithmetic": "lax.shift_right_arithmetic"}  # fmt: skip
UNARY_FUNCTIONS = {
    "exp": "jnp.exp", "exp2": "jnp.exp2", "log": "jnp.log", "log1p": "jnp.log1p", "expm1": "jnp.expm1",
    "tanh": "jnp.tanh", "logistic": "jax.nn.sigmoid", "abs": "jnp.abs", "sqrt": "jnp.sqrt",
    "rsqrt": "lax.rsqrt", "cbrt": "lax.cbrt", "erf": "lax.erf", "erfc": "lax.erfc", "erf_inv": "lax.erf_inv",
    "sin": "jnp.sin", "cos": "jnp.cos", "tan": "jnp.tan", "asin": "jnp.arcsin", "acos": "jnp.arccos",
    "atan": "jnp.arctan", "sinh": "jnp.sinh", "cosh": "jnp.cosh", "asinh": "jnp.arcsinh",
    "acosh": "jnp.arccosh", "atanh": "jnp.arctanh", "floor": "jnp.floor", "ceil": "jnp.ceil",
    "sign": "jnp.sign", "square": "jnp.square", "is_finite": "jnp.isfinite", "lgamma": "lax.lgamma",
    "digamma": "lax.digamma", "population_count": "lax.population_count", "imag": "jnp.imag",
    "real": "jnp.real", "conj": "jnp.conj", "bessel_i0e": "lax.bessel_i0e", "bessel_i1e": "lax.bessel_i1e",
}  # fmt: skip


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat")) or dtype == ""


def write_binary(ctx: OpContext) -> str:
    x, y = ctx.args
    prim = ctx.a.prim
    if prim in BINARY_OPERATORS:
        return f"{x} {BINARY_OPERATORS[prim]} {y}"
    if prim in FLOAT_ONLY_OPERATORS:
        if _is_float(ctx.out_dtype()):
            return f"{x} {FLOAT_ONLY_OPERATORS[prim]} {y}"
        return f"lax.{prim}({x}, {y})"
    return f"{BINARY_FUNCTIONS[prim]}({x}, {y})"


def write_unary(ctx: OpContext) -> str:
    return f"{UNARY_FUNCTIONS[ctx.a.prim]}({ctx.args[0]})"


def write_neg(ctx: OpContext) -> str:
    return f"-{ctx.args[0]}"


def write_not(ctx: OpContext) -> str:
    return f"~{ctx.args[0]}"


def write_integer_pow(ctx: OpContext) -> str:
    return f"lax.integer_pow({ctx.args[0]}, {ctx.p('y')})"


def write_round(ctx: OpContext) -> str:
    method = ctx.p("rounding_method")
    return f"lax.round({ctx.args[0]}, lax.RoundingMethod.{getattr(method, 'name', method)})"


def write_convert(ctx: OpContext) -> str:
    return f"{ctx.args[0]}.astype({dtype_code(str(np.dtype(ctx.p('new_dtype'))))})"


def write_reduce(ctx: OpContext) -> str:
    return f"lax.{ctx.a.prim}({ctx.args[0]}, axes={tuple(ctx.p('axes'))!r})"


def write_arg_reduce(ctx: OpContext) -> str:
    (axis,) = ctx.p("axes")
    index = dtype_code(str(np.dtype(ctx.p("index_dtype"))))
    return f"lax.{ctx.a.prim}({ctx.args[0]}, axis={axis}, index_dtype={index})"


def write_cumulative(ctx: OpContext) -> str:
    return f"lax.{ctx.a.prim}({ctx.args[0]}, axis={ctx.p('axis')}, reverse={ctx.p('reverse')})"


def _precision(value: Any) -> str:
    if value is None:
        return ""
    items = value if isinstance(value, tuple | list) else (value,)
    names = [getattr(v, "name", str(v)) for v in items]
    if all(n == "DEFAULT" for n in names):
        return ""
    if len(set(names)) == 1:
        return f", precision=lax.Precision.{names[0]}"
    return ", precision=(" + ", ".join(f"lax.Precision.{n}" for n in names) + ")"


def _preferred(ctx: OpContext) -> str:
    pref = ctx.a.params.get("preferred_element_type")
    return f", preferred_element_type={dtype_code(str(np.dtype(pref)))}" if pref is not None else ""


def write_dot_general(ctx: OpContext) -> str:
    (lc, rc), (lb, rb) = ctx.p("dimension_numbers")
    dims = f"(({tuple(lc)!r}, {tuple(rc)!r}), ({tuple(lb)!r}, {tuple(rb)!r}))"
    x, y = ctx.args
    return f"lax.dot_general({x}, {y}, {dims}{_precision(ctx.p('precision'))}{_preferred(ctx)})"


def write_conv(ctx: OpContext) -> str:
    dn = ctx.p("dimension_numbers")
    numbers = (
        f"lax.ConvDimensionNumbers(lhs_spec={tuple(dn.lhs_spec)!r}, rhs_spec={tuple(dn.rhs_spec)!r}, "
        f"out_spec={tuple(dn.out_spec)!r})"
    )
    x, w = ctx.args
    parts = [
        f"window_strides={ctx.size('window_strides')}",
        f"padding={ctx.size('padding')}",
        f"lhs_dilation={ctx.size('lhs_dilation')}",
        f"rhs_dilation={ctx.size('rhs_dilation')}",
        f"dimension_numbers={numbers}",
    ]
    if ctx.p("feature_group_count") != 1:
        parts.append(f"feature_group_count={ctx.size('feature_group_count')}")
    if ctx.p("batch_group_count") != 1:
        parts.append(f"batch_group_count={ctx.size('batch_group_count')}")
    tail = _precision(ctx.p("precision")) + _preferred(ctx)
    return f"lax.conv_general_dilated(\n{ctx.writer.indent}    {x}, {w}, " + ", ".join(parts) + tail + ")"


def write_reshape(ctx: OpContext) -> str:
    if ctx.a.params.get("dimensions") is not None:
        raise UnsupportedPrimitive("reshape", "reshape with a dimension permutation", ctx.a.origin)
    return f"{ctx.args[0]}.reshape({ctx.size('new_sizes')})"


def write_broadcast(ctx: OpContext) -> str:
    shape = ctx.size("shape")
    dims = tuple(ctx.p("broadcast_dimensions"))
    if ctx.a.ins[0].is_literal:
        return f"jnp.full({shape}, {ctx.args[0]}, {dtype_code(ctx.out_dtype())})"
    return f"lax.broadcast_in_dim({ctx.args[0]}, {shape}, {dims!r})"


def write_squeeze(ctx: OpContext) -> str:
    return f"lax.squeeze({ctx.args[0]}, {tuple(ctx.p('dimensions'))!r})"


def write_transpose(ctx: OpContext) -> str:
    return f"{ctx.args[0]}.transpose({tuple(ctx.p('permutation'))!r})"


def write_select(ctx: OpContext) -> str:
    pred, *cases = ctx.args
    if len(cases) == 2 and ctx.in_dtype(0) == "bool":
        return f"jnp.where({pred}, {cases[1]}, {cases[0]})"
    return f"lax.select_n({pred}, {', '.join(cases)})"


def write_iota(ctx: OpContext) -> str:
    dtype = dtype_code(str(np.dtype(ctx.p("dtype"))))
    return f"lax.broadcasted_iota({dtype}, {ctx.size('shape')}, {ctx.p('dimension')})"


def write_rev(ctx: OpContext) -> str:
    return f"lax.rev({ctx.args[0]}, {tuple(ctx.p('dimensions'))!r})"


def write_slice(ctx: OpContext) -> str:
    strides = ctx.a.params.get("strides")
    tail = f", {ctx.size('strides')}" if strides is not None else ""
    return f"lax.slice({ctx.args[0]}, {ctx.size('start_indices')}, {ctx.size('limit_indices')}{tail})"


def write_dynamic_slice(ctx: OpContext) -> str:
    x, *idx = ctx.args
    return f"lax.dynamic_slice({x}, ({', '.join(idx)},), {ctx.size('slice_sizes')})"


def write_dynamic_update_slice(ctx: OpContext) -> str:
    x, update, *idx = ctx.args
    return f"lax.dynamic_update_slice({x}, {update}, ({', '.join(idx)},))"


def write_concatenate(ctx: OpContext) -> str:
    return f"lax.concatenate([{', '.join(ctx.args)}], {ctx.p('dimension')})"


def write_pad(ctx: OpContext) -> str:
    x, value = ctx.args
    return f"lax.pad({x}, {value}, {ctx.size('padding_config')})"


def write_clamp(ctx: OpContext) -> str:
    lo, x, hi = ctx.args
    return f"lax.clamp({lo}, {x}, {hi})"


def write_split(ctx: OpContext) -> str:
    return f"lax.split({ctx.args[0]}, {ctx.size('sizes')}, axis={ctx.p('axis')})"


def _window_args(ctx: OpContext) -> str:
    return (
        f"window_dimensions={ctx.size('window_dimensions')}, window_strides={ctx.size('window_strides')}, "
        f"padding={ctx.size('padding')}, base_dilation={ctx.size('base_dilation')}, "
        f"window_dilation={ctx.size('window_dilation')}"
    )


WINDOW_MONOIDS = {"reduce_window_sum": ("lax.add", "0"), "reduce_window_max": ("lax.max", "-inf"),
                  "reduce_window_min": ("lax.min", "inf")}  # fmt: skip


def write_window_monoid(ctx: OpContext) -> str:
    fn, init = WINDOW_MONOIDS[ctx.a.prim]
    dtype = ctx.in_dtype(0)
    if _is_float(dtype):
        init_code = {"0": "0.0", "-inf": "-jnp.inf", "inf": "jnp.inf"}[init]
    else:
        info = np.iinfo(np.dtype(dtype))
        init_code = {"0": "0", "-inf": str(info.min), "inf": str(info.max)}[init]
    return (
        f"lax.reduce_window(\n{ctx.writer.indent}    {ctx.args[0]}, {init_code}, {fn}, {_window_args(ctx)})"
    )


def write_gather(ctx: OpContext) -> str:
    dn = ctx.p("dimension_numbers")
    fields = ", ".join(
        f"{f}={tuple(getattr(dn, f))!r}"
        for f in (
            "offset_dims",
            "collapsed_slice_dims",
            "start_index_map",
            "operand_batching_dims",
            "start_indices_batching_dims",
        )  # fmt: skip
        if hasattr(dn, f)
    )
    mode = ctx.p("mode")
    fill = ctx.a.params.get("fill_value")
    x, idx = ctx.args
    return (
        f"lax.gather({x}, {idx}, lax.GatherDimensionNumbers({fields}), slice_sizes={ctx.size('slice_sizes')}, "
        f"indices_are_sorted={ctx.p('indices_are_sorted')}, unique_indices={ctx.p('unique_indices')}, "
        f"mode=lax.GatherScatterMode.{getattr(mode, 'name', mode)}, fill_value={fill!r})"
    )


def write_sort(ctx: OpContext) -> str:
    return (
        f"lax.sort(({', '.join(ctx.args)},), dimension={ctx.p('dimension')}, is_stable={ctx.p('is_stable')}, "
        f"num_keys={ctx.p('num_keys')})"
    )


def write_top_k(ctx: OpContext) -> str:
    return f"lax.top_k({ctx.args[0]}, {ctx.size('k')})"


def write_reduce_precision(ctx: OpContext) -> str:
    return (
        f"lax.reduce_precision({ctx.args[0]}, exponent_bits={ctx.p('exponent_bits')}, "
        f"mantissa_bits={ctx.p('mantissa_bits')})"
    )


def write_scan(ctx: OpContext) -> str:
    """`lax.scan` with its body as a local function; the body reads the loop's constants by closure."""
    w = ctx.writer
    n_consts, n_carry = ctx.p("num_consts"), ctx.p("num_carry")
    bodies: list[Program] = [op.bodies["jaxpr"] for op in ctx.ops]
    consts = ctx.args[:n_consts]
    init = ctx.args[n_consts : n_consts + n_carry]
    xs = ctx.args[n_consts + n_carry :]
    w.counter += 1
    name = f"scan_body_{w.counter}"
    carry_names = [f"carry{w.counter}_{i}" for i in range(len(init))]
    x_names = [f"x{w.counter}_{i}" for i in range(len(xs))]
    env = dict(zip(bodies[0].invars, [*consts, *carry_names, *x_names], strict=True))
    w.emit(f"def {name}(carry, xs):")
    outer, w.indent = w.indent, w.indent + "    "
    if carry_names:
        w.emit(f"{_tuple(carry_names)} = carry")
    if x_names:
        w.emit(f"{_tuple(x_names)} = xs")
    with w.fitter.scope():
        for i, code in enumerate([*carry_names, *x_names], start=n_consts):
            w.fitter.add(code, [b.avals[b.invars[i]][0] for b in bodies])
        outs = w.body(bodies, env)
        w.emit(f"return {_tuple(outs[:n_carry])}, {_tuple(outs[n_carry:])}")
    w.indent = outer
    w.last_origin = ""
    return (
        f"lax.scan({name}, {_tuple(init)}, {_tuple(xs)}, length={ctx.size('length')}, "
        f"reverse={ctx.p('reverse')}, unroll={ctx.p('unroll')!r})"
    )


def _tuple(items: list[str]) -> str:
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


WRITERS: dict[str, Writer] = {
    **{p: write_binary for p in (*BINARY_OPERATORS, *FLOAT_ONLY_OPERATORS, *BINARY_FUNCTIONS)},
    **{p: write_unary for p in UNARY_FUNCTIONS},
    **{
        p: write_reduce
        for p in (
            "reduce_sum",
            "reduce_max",
            "reduce_min",
            "reduce_prod",
            "reduce_and",
            "reduce_or",
            "reduce_xor",
        )
    },  # fmt: skip
    **{p: write_arg_reduce for p in ("argmax", "argmin")},
    **{p: write_cumulative for p in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")},
    **{p: write_window_monoid for p in WINDOW_MONOIDS},
    "neg": write_neg,
    "not": write_not,
    "integer_pow": write_integer_pow,
    "round": write_round,
    "convert_element_type": write_convert,
    "dot_general": write_dot_general,
    "conv_general_dilated": write_conv,
    "reshape": write_reshape,
    "broadcast_in_dim": write_broadcast,
    "squeeze": write_squeeze,
    "transpose": write_transpose,
    "select_n": write_select,
    "iota": write_iota,
    "rev": write_rev,
    "slice": write_slice,
    "dynamic_slice": write_dynamic_slice,
    "dynamic_update_slice": write_dynamic_update_slice,
    "concatenate": write_concatenate,
    "pad": write_pad,
    "clamp": write_clamp,
    "split": write_split,
    "gather": write_gather,
    "sort": write_sort,
    "top_k": write_top_k,
    "reduce_precision": write_reduce_precision,
    "scan": write_scan,
}
