"""Turn jaxpr equations back into Python: `jnp`/`lax` expressions for kernel bodies, and layout glue.

Kernel bodies work on blocks whose shapes differ from the jaxpr's, so every expression here broadcasts
(`jnp.maximum`, `jnp.where`, operators) instead of using shape-exact `lax` calls, and layout equations
that only relabel dims (broadcast, transpose, unit reshapes) become aliases. A few primitives have no
Mosaic lowering in JAX 0.10.2 (`sign`, `expm1`, `cbrt`, floor division on ints through `sign`) and are
written with ones that do.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np

DTYPE_CODE = {
    "float32": "jnp.float32",
    "bfloat16": "jnp.bfloat16",
    "float16": "jnp.float16",
    "float64": "jnp.float64",
    "int32": "jnp.int32",
    "int16": "jnp.int16",
    "int8": "jnp.int8",
    "uint8": "jnp.uint8",
    "uint32": "jnp.uint32",
    "int64": "jnp.int64",
    "bool": "jnp.bool_",
}

SHORT_DTYPE = {
    "float32": "f32",
    "bfloat16": "bf16",
    "float16": "f16",
    "int32": "i32",
    "int8": "i8",
    "uint8": "u8",
    "bool": "bool",
    "int16": "i16",
    "uint32": "u32",
    "float64": "f64",
    "int64": "i64",
}


class EmitError(Exception):
    """A primitive or parameter this emitter cannot write."""


def dtype_name(aval: Any) -> str:
    if str(aval.dtype) == "bfloat16":
        return "bfloat16"
    try:
        return str(np.dtype(aval.dtype))
    except TypeError:  # extended dtypes such as PRNG keys
        return str(aval.dtype)


def dtype_code(name: str) -> str:
    if name not in DTYPE_CODE:
        raise EmitError(f"dtype {name} is not supported in kernels")
    return DTYPE_CODE[name]


def is_float(name: str) -> bool:
    return name.startswith("float") or name == "bfloat16"


def literal_code(value: Any, dtype: str) -> str:
    """A Python literal for a scalar value of the given dtype."""
    v = np.asarray(value).item()
    if dtype == "bool":
        return "True" if v else "False"
    if is_float(dtype):
        f = float(v)
        if math.isnan(f):
            return "jnp.nan"
        if math.isinf(f):
            return "jnp.inf" if f > 0 else "-jnp.inf"
        text = repr(f)
        return text
    return str(int(v))


def transpose_code(name: str, perm: tuple[int, ...]) -> str:
    """`jnp.transpose` code, or just the name when the permutation is the identity."""
    return name if list(perm) == sorted(perm) else f"jnp.transpose({name}, {int_tuple(perm)})"


def int_tuple(values: Any) -> tuple[int, ...]:
    """A jaxpr param's integers as Python ints, for emitted code: jnp helpers leave numpy scalars in some
    (`jnp.repeat`'s broadcast dimensions), whose repr (`np.int64(1)`) would not run in the generated module."""
    return tuple(int(v) for v in values)


def paren(code: str) -> str:
    """Parenthesise anything that is not a plain name or an unsigned number."""
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", code) or re.fullmatch(r"[0-9][0-9eE.+\-]*", code):
        return code
    return f"({code})"


_UNARY: dict[str, Callable[[str], str]] = {
    "neg": lambda a: f"-{paren(a)}",
    "exp": lambda a: f"jnp.exp({a})",
    "exp2": lambda a: f"jnp.exp2({a})",
    "log": lambda a: f"jnp.log({a})",
    "log1p": lambda a: f"jnp.log1p({a})",
    "expm1": lambda a: f"(jnp.exp({a}) - 1.0)",
    "tanh": lambda a: f"jnp.tanh({a})",
    "logistic": lambda a: f"jax.nn.sigmoid({a})",
    "abs": lambda a: f"jnp.abs({a})",
    "sqrt": lambda a: f"jnp.sqrt({a})",
    "rsqrt": lambda a: f"lax.rsqrt({a})",
    "erf": lambda a: f"lax.erf({a})",
    "erfc": lambda a: f"(1.0 - lax.erf({a}))",
    "erf_inv": lambda a: f"lax.erf_inv({a})",
    "floor": lambda a: f"jnp.floor({a})",
    "ceil": lambda a: f"jnp.ceil({a})",
    "sin": lambda a: f"jnp.sin({a})",
    "cos": lambda a: f"jnp.cos({a})",
    "tan": lambda a: f"jnp.tan({a})",
    "asin": lambda a: f"jnp.arcsin({a})",
    "acos": lambda a: f"jnp.arccos({a})",
    "atan": lambda a: f"jnp.arctan({a})",
    "sinh": lambda a: f"jnp.sinh({a})",
    "cosh": lambda a: f"jnp.cosh({a})",
    "asinh": lambda a: f"jnp.arcsinh({a})",
    "acosh": lambda a: f"jnp.arccosh({a})",
    "atanh": lambda a: f"jnp.arctanh({a})",
    # Mosaic checks finiteness on float32 vectors only ('tpu.weird' op Input type must be F32); widening a
    # bfloat16/float16 value is exact, so the answer is the same
    "is_finite": lambda a: f"jnp.isfinite(jnp.asarray({a}, jnp.float32))",
    "square": lambda a: f"{paren(a)} * {paren(a)}",
    "copy": lambda a: a,
    "copy_p": lambda a: a,
}

_BINARY_OP = {
    "add": "+",
    "add_any": "+",
    "sub": "-",
    "mul": "*",
    "eq": "==",
    "ne": "!=",
    "lt": "<",
    "le": "<=",
    "gt": ">",
    "ge": ">=",
    "and": "&",
    "or": "|",
    "xor": "^",
}

_BINARY_FN = {
    "max": "jnp.maximum",
    "min": "jnp.minimum",
    "pow": "jnp.power",
    "atan2": "jnp.arctan2",
    "rem": "lax.rem",
    "nextafter": "jnp.nextafter",
    "shift_left": "lax.shift_left",
    "shift_right_logical": "lax.shift_right_logical",
    "shift_right_arithmetic": "lax.shift_right_arithmetic",
}


def elementwise_expr(
    eqn: Any, args: list[str], out_dtype: str, in_dtypes: list[str], scalar_out: bool
) -> str:
    """The expression for one elementwise (or cast) equation, given its operands' code."""
    name = eqn.primitive.name
    p = eqn.params
    if name in _UNARY:
        return _UNARY[name](args[0])
    if name in _BINARY_OP:
        return f"{paren(args[0])} {_BINARY_OP[name]} {paren(args[1])}"
    if name in _BINARY_FN:
        if name.startswith("shift_"):
            # lax shifts take no weak-typed Python ints: a literal shift count gets the operands' dtype
            args = [f"{dtype_code(out_dtype)}({a})" if re.fullmatch(r"-?[0-9]+", a) else a for a in args]
        return f"{_BINARY_FN[name]}({args[0]}, {args[1]})"
    if name == "div":
        if is_float(out_dtype):
            return f"{paren(args[0])} / {paren(args[1])}"
        return f"lax.div({args[0]}, {args[1]})"
    if name == "not":
        return f"~{paren(args[0])}" if out_dtype == "bool" else f"jnp.invert({args[0]})"
    if name == "sign":
        one, zero = ("1.0", "0.0") if is_float(out_dtype) else ("1", "0")
        a = args[0]
        return f"jnp.where({paren(a)} > 0, {one}, jnp.where({paren(a)} < 0, -{one}, {zero})).astype({dtype_code(out_dtype)})"
    if name == "cbrt":
        a = args[0]
        return f"jnp.where({paren(a)} < 0, -1.0, 1.0) * jnp.abs({a}) ** (1.0 / 3.0)"
    if name == "integer_pow":
        y = int(p["y"])
        if y == 2:
            return f"{paren(args[0])} * {paren(args[0])}"
        return f"lax.integer_pow({args[0]}, {y})"
    if name == "select_n":
        pred, cases = args[0], args[1:]
        if len(cases) == 1:
            return cases[0]
        if len(cases) == 2:
            if in_dtypes[0] == "bool" and out_dtype == "bool":
                # a select between masks: Mosaic cannot relayout an i1 select (`Invalid relayout ...
                # vector<...xi1>`), so write it as logic (tril/triu of a constant lands here)
                if (cases[1], cases[0]) == ("True", "False"):
                    return pred
                if (cases[1], cases[0]) == ("False", "True"):
                    return f"~{paren(pred)}"
                return f"({paren(pred)} & {paren(cases[1])}) | (~{paren(pred)} & {paren(cases[0])})"
            if in_dtypes[0] == "bool":
                return f"jnp.where({pred}, {cases[1]}, {cases[0]})"
            return f"jnp.where({paren(pred)} != 0, {cases[1]}, {cases[0]})"
        expr = cases[-1]
        for k in range(len(cases) - 2, -1, -1):
            expr = f"jnp.where({paren(pred)} == {k}, {cases[k]}, {expr})"
        return expr
    if name == "clamp":
        lo, x, hi = args
        return f"jnp.minimum(jnp.maximum({x}, {lo}), {hi})"
    if name == "round":
        method = p.get("rounding_method")
        m = getattr(method, "name", str(method)).split(".")[-1]
        return f"lax.round({args[0]}, lax.RoundingMethod.{m})"
    if name == "reduce_precision":
        return f"lax.reduce_precision({args[0]}, exponent_bits={p['exponent_bits']}, mantissa_bits={p['mantissa_bits']})"
    if name == "bitcast_convert_type":
        return f"lax.bitcast_convert_type({args[0]}, {dtype_code(dtype_name_from(p['new_dtype']))})"
    if name == "convert_element_type":
        target = dtype_name_from(p["new_dtype"])
        if scalar_out:
            return f"jnp.asarray({args[0]}, {dtype_code(target)})"
        return f"{paren(args[0])}.astype({dtype_code(target)})"
    raise EmitError(f"no kernel code for the primitive {name}")


def dtype_name_from(dt: Any) -> str:
    s = str(np.dtype(dt)) if str(dt) != "bfloat16" else "bfloat16"
    return s


def shape_comment(dtype: str, dims: list[str]) -> str:
    short = SHORT_DTYPE.get(dtype, dtype)
    if not dims:
        return f"{short}[]"
    return f"{short}[{', '.join(dims)}]"
