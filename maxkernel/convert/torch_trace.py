"""Trace a PyTorch module to a JAX program with torchax (sandboxed conversion child only).

The module's forward runs once under torchax with abstract JAX values (`jax.make_jaxpr`), parameters and
buffers passed in as arguments (torchax's `JittableModule.functional_call`), so nothing is allocated at
the task's own sizes: the model is built on PyTorch's `meta` device there. The program's signature is the
forward's tensor arguments, then every parameter and buffer (tied parameters once). Each traced operation
keeps the line of the user's file it came from, for comments and for refusals.
"""

from __future__ import annotations

import dataclasses
import inspect
import keyword
import linecache
import re
import types
from pathlib import Path
from typing import Any

from maxkernel.convert.program import Program, ProgramError, flatten_closed, primitives
from maxkernel.convert.refusals import ConversionRefused, Refusal
from maxkernel.convert.torch_env import torchax_env

RANDOM_PRIMITIVES = frozenset(
    {
        "random_bits",
        "random_seed",
        "random_wrap",
        "random_unwrap",
        "random_split",
        "random_fold_in",
        "threefry2x32",
        "rng_bit_generator",
        "rng_uniform",
    }  # fmt: skip
)


@dataclasses.dataclass
class Traced:
    program: Program
    input_names: list[str]
    """The forward's tensor arguments, in order (valid Python identifiers)."""
    state_names: list[str]
    """Identifiers for the parameters and buffers, in the program's order."""
    state_keys: list[str]
    """The same, as state-dict keys (`conv.weight`)."""
    static_args: list[Any]
    """Non-tensor forward arguments, baked into the trace (listed for the record)."""
    outputs: int
    jaxpr_text: str = ""


def identifier(name: str, taken: set[str]) -> str:
    base = re.sub(r"\W", "_", name).strip("_") or "arg"
    if base[0].isdigit() or keyword.iskeyword(base) or base in ("jax", "jnp", "lax", "np", "math"):
        base = f"p_{base}"
    out, n = base, 1
    while out in taken:
        n += 1
        out = f"{base}_{n}"
    taken.add(out)
    return out


def user_origin(frames: list[tuple[str, int]], source_path: Path) -> str:
    """`file.py:14  x = self.conv(x)` for the innermost frame in the user's file, else ''."""
    target = str(source_path)
    for file_name, line in frames:
        if file_name == target:
            text = linecache.getline(target, line).strip()
            return f"{source_path.name}:{line}  {text}"[:160]
    return ""


def origin_of_eqn(source_path: Path) -> Any:
    def origin(eqn: Any) -> str:
        tb = getattr(eqn.source_info, "traceback", None)
        if tb is None:
            return ""
        return user_origin([(f.file_name, f.line_num) for f in tb.frames], source_path)

    return origin


def torch_op_of_eqn(eqn_frames: list[tuple[str, str]]) -> str:
    """The torchax lowering an operation came from (`_aten_cumsum` -> `aten.cumsum`)."""
    for file_name, func in eqn_frames:
        if "torchax" in file_name and func.startswith(("_aten_", "_torch_")):
            return func.lstrip("_").replace("_", ".", 1)
    return ""


def exception_origin(exc: BaseException, source_path: Path) -> str:
    frames: list[tuple[str, int]] = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    return user_origin(list(reversed(frames)), source_path)


def without_dropout(model: Any) -> list[str]:
    """Put every nn.Dropout* module in eval mode (identity); returns their names for the record."""
    import torch

    removed = []
    for name, sub in model.named_modules():
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.p > 0:
            sub.eval()
            removed.append(name or "model")
    return removed


def build(
    cls: Any, get_inputs: Any, get_init_inputs: Any, *, meta: bool, seed: int = 0
) -> tuple[Any, list[Any]]:
    """The model and its forward arguments, on the meta device (no memory) or on the CPU for real."""
    import torch

    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            init = list(get_init_inputs())
            model = cls(*init)
            inputs = list(get_inputs())
    else:
        init = list(get_init_inputs())
        model = cls(*init)
        inputs = list(get_inputs())
    if not isinstance(model, torch.nn.Module):
        raise ConversionRefused(Refusal(kind="entry_points", what=f"{cls!r} (not an nn.Module)"))
    without_dropout(model)
    return model, inputs


def forward_arg_names(model: Any, count: int) -> list[str]:
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]  # fmt: skip
    except (TypeError, ValueError):
        params = []
    if len(params) < count:
        params += [f"input{i}" for i in range(len(params), count)]
    return params[:count]


def trace(model: Any, inputs: list[Any], source_path: Path) -> Traced:
    import jax
    import torch

    env = torchax_env()  # first: it makes torchax importable on this PyTorch
    from torchax.interop import JittableModule
    from torchax.ops import mappings

    jm = JittableModule(model, dedup_parameters=True)
    param_keys, buffer_keys = list(jm.params), list(jm.buffers)
    state_keys = param_keys + buffer_keys

    def spec(t: Any) -> Any:
        if t.dtype.is_complex:
            raise ConversionRefused(Refusal(kind="input_type", what=f"a complex tensor ({t.dtype})"))
        return jax.ShapeDtypeStruct(tuple(int(d) for d in t.shape), mappings.t2j_dtype(t.dtype))

    tensor_pos = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
    statics = [a for a in inputs if not isinstance(a, torch.Tensor)]
    for s in statics:
        if not isinstance(s, int | float | bool | str | type(None) | tuple | list):
            raise ConversionRefused(
                Refusal(kind="input_type", what=f"a forward argument of type {type(s).__name__}")
            )
    names_raw = forward_arg_names(model, len(inputs))
    taken: set[str] = set()
    input_names = [identifier(names_raw[i], taken) for i in tensor_pos]
    state_names = [identifier(k, taken) for k in state_keys]
    states_all = {**jm.params, **jm.buffers}
    arg_specs = [spec(inputs[i]) for i in tensor_pos] + [spec(states_all[k]) for k in state_keys]
    n_in = len(tensor_pos)
    out_count: list[int] = []

    def program(*flat: Any) -> Any:
        args = list(inputs)
        for pos, value in zip(tensor_pos, flat[:n_in], strict=True):
            args[pos] = value
        states = dict(zip(state_keys, flat[n_in:], strict=True))
        params = {k: states[k] for k in param_keys}
        buffers = {k: states[k] for k in buffer_keys}
        params, buffers, args = env.j2t_iso((params, buffers, args))
        with env:
            out = jm.functional_call("forward", params, buffers, *args)
        leaves = out if isinstance(out, tuple | list) else [out]
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                raise ConversionRefused(
                    Refusal(kind="output_type", what=f"an output of type {type(leaf).__name__}")
                )
        out_count.append(len(leaves))
        return tuple(env.t2j_iso(list(leaves)))

    try:
        closed = jax.make_jaxpr(program)(*arg_specs)
    except ConversionRefused:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure of the user's forward becomes a named refusal
        raise ConversionRefused(classify_trace_error(exc, source_path)) from exc
    try:
        prog = flatten_closed(closed, origin_of_eqn(source_path))
    except ProgramError as exc:
        kind = "randomness" if "key" in str(exc) else "captured_constant"
        raise ConversionRefused(Refusal(kind=kind, what=f"the traced program ({exc})")) from exc
    random = sorted(set(primitives(prog)) & RANDOM_PRIMITIVES)
    if random:
        raise ConversionRefused(Refusal(kind="randomness", what=f"random numbers ({', '.join(random)})"))
    return Traced(prog, input_names, state_names, state_keys, statics, out_count[0], str(closed)[:20000])


RANDOM_LOWERING = re.compile(r"rand|bernoulli|dropout|normal|uniform|multinomial|exponential")


def _torchax_frames(exc: BaseException) -> list[str]:
    """Names of torchax's op lowerings the exception passed through, innermost last."""
    names = []
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if "torchax" in code.co_filename and code.co_name.startswith(("_aten_", "_torch_", "_")):
            names.append(code.co_name)
        tb = tb.tb_next
    return names


def classify_trace_error(exc: BaseException, source_path: Path) -> Refusal:
    import jax

    where = exception_origin(exc, source_path)
    name = type(exc).__name__
    lowering = _torchax_frames(exc)
    random = [f for f in lowering if RANDOM_LOWERING.search(f)]
    if random:  # torchax's random lowerings do not trace abstractly; either way it is randomness in forward
        return Refusal(kind="randomness", what=f"random numbers ({random[0].lstrip('_')})", where=where)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else name
    if name == "OperatorNotFound":
        m = re.search(r"name (\S+)", text)
        return Refusal(kind="torch_op", what=f"torch op {m.group(1) if m else text}", where=where)
    if isinstance(exc, jax.errors.ConcretizationTypeError | jax.errors.TracerBoolConversionError |
                  jax.errors.TracerIntegerConversionError | jax.errors.TracerArrayConversionError):  # fmt: skip
        return Refusal(kind="data_dependent", what="a branch or conversion on a tensor's value", where=where)
    if isinstance(exc, NotImplementedError):
        return Refusal(kind="torch_op", what=text[:200], where=where)
    return Refusal(kind="task_code", what=f"{name} while tracing forward", where=where, detail=text[:300])


def state_dict_arrays(model: Any, keys: list[str]) -> list[Any]:
    """The model's parameter and buffer values in `keys` order, as numpy arrays."""
    sd = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    return [sd[k].detach().cpu().numpy() for k in keys]


def load_state(model: Any, keys: list[str], arrays: list[Any]) -> None:
    """Set the model's parameters and buffers (tied ones share a key) to `arrays`."""
    import numpy as np
    import torch

    named = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    with torch.no_grad():
        for k, a in zip(keys, arrays, strict=True):
            named[k].copy_(torch.from_numpy(np.array(a)).to(named[k].dtype))


def module_types(module: types.ModuleType) -> str:
    return getattr(module, "__name__", "")
