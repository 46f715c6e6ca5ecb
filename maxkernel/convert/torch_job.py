"""The conversion of one PyTorch file, run as a sandboxed job (`maxkernel.convert.torch_job:convert_job`).

Steps (each announced as a stage, so a hang or crash says where it was):

1. trace the model at the file's own sizes (on PyTorch's meta device: nothing allocated);
2. find a CPU scale: the file's size constants shrunk until the inputs, weights and outputs fit
   `CPU_BYTES` and the work `CPU_FLOPS`, checking that the traced program keeps its structure; a third,
   non-proportional scale is traced too, so sizes that follow the inputs are fitted on three points;
3. write `reference.py`: a `get_inputs(scale=..., seed=...)` whose recipes were read off PyTorch's own
   draws (`input_recipes`) and a `computation` written back from the traced program (`jax_source`);
4. verify: the written reference's own trace must be torchax's program exactly (at the file's sizes), and
   on `draws` random draws of PyTorch's own inputs and weights and `draws` of the reference's, PyTorch and
   the reference must agree within `CHECK_TOLERANCE`.

Whatever stops the conversion comes back as a `Refusal` naming the construct.
"""

from __future__ import annotations

import math
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from maxkernel.convert import input_recipes, torch_module, torch_trace
from maxkernel.convert.jax_source import SizeNotFitted, SourceWriter, UnsupportedPrimitive
from maxkernel.convert.program import Program, flatten_closed, structure_difference
from maxkernel.convert.refusals import ConversionRefused, Refusal

CPU_BYTES = 24 << 20
"""Inputs + weights + outputs at the CPU scale: small enough that a candidate kernel's correctness runs
(TPU interpret mode, ~150x slower than XLA on the CPU) take seconds."""
CPU_FLOPS = 5e8
"""Matmul/conv work at the CPU scale (a 512^3 matmul is 2.7e8 and takes ~0.5 s in TPU interpret mode)."""
OWN_SCALE_LIMIT = 512 << 20
"""A task whose sizes cannot be shrunk is verified at its own sizes only up to this many bytes."""
SHRINK_FACTORS = (1.0, 0.5, 0.25, 0.125, 0.0625, 1 / 32, 1 / 64, 1 / 128)
CHECK_TOLERANCE: dict[str, tuple[float, float]] = {
    "float32": (1e-3, 1e-3),
    "float64": (1e-8, 1e-8),
    "bfloat16": (2e-2, 2e-2),
    "float16": (2e-3, 2e-3),
}
"""(atol, rtol) for PyTorch vs the converted reference on the same inputs: ten times tighter than the task's
(float32: a sum over thousands of elements in another order differs by ~1e-4 relative; a wrong op by far more)."""
TASK_TOLERANCE: dict[str, float] = {"float32": 1e-3, "float64": 1e-6, "bfloat16": 2e-2, "float16": 1e-2}
"""atol = rtol written into kernel_task.yaml, by the outputs' dtype (KernelBench files use its own 1e-2)."""
KERNELBENCH_TOLERANCE = 1e-2
RECIPE_SEEDS = 4
BENIGN_PRIMITIVES = frozenset(
    {"broadcast_in_dim", "reshape", "squeeze", "convert_element_type", "add", "mul", "sub"}
)
"""Left out when a mismatch lists the program's primitives (they are everywhere and rarely the culprit)."""


def program_bytes(p: Program) -> int:
    ids = list(p.invars) + [r.var for r in p.outs if r.var is not None]
    total = 0
    for vid in ids:
        shape, dtype = p.avals[vid]
        total += math.prod(shape) * np.dtype(dtype).itemsize
    return total


def program_flops(p: Program) -> float:
    flops = 0.0
    for op in p.ops:
        outs = [p.avals[o] for o in op.outs if o is not None]
        size = sum(math.prod(s) for s, _ in outs)
        if op.prim == "dot_general" and not op.ins[0].is_literal:
            (lc, _rc), _ = op.params["dimension_numbers"]
            lhs = p.avals[op.ins[0].var][0]
            flops += 2.0 * size * math.prod(lhs[d] for d in lc)
        elif op.prim == "conv_general_dilated" and not op.ins[1].is_literal:
            rhs = p.avals[op.ins[1].var][0]
            out_feature = op.params["dimension_numbers"].rhs_spec[0]
            flops += 2.0 * size * math.prod(rhs) / max(1, rhs[out_feature])
        else:
            flops += size
    return flops


class _Stages:
    def __init__(self, ctx: Any) -> None:
        self.ctx, self.t0, self.times = ctx, time.perf_counter(), {}
        self.name = ""

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        if self.name:
            self.times[self.name] = round(now - self.t0, 2)
        self.name, self.t0 = name, now
        self.ctx.stage(name)


def convert_job(payload: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Sandbox entry. payload: source_path, class_name, draws, kernelbench."""
    stage = _Stages(ctx)
    stage("load")
    ctx.guard()
    source_path = Path(payload["source_path"])
    started = time.perf_counter()
    try:
        result = _convert(source_path, payload, stage, Path(ctx.run_dir))
    except ConversionRefused as exc:
        result = {"ok": False, "refusal": exc.refusal.model_dump()}
    except Exception as exc:  # noqa: BLE001 - the user's file failed somewhere: report it, named
        where = torch_trace.exception_origin(exc, source_path)
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        result = {"ok": False, "refusal": Refusal(kind="task_code", what=type(exc).__name__, where=where,
                  detail=text).model_dump(), "traceback": traceback.format_exc(limit=6)[-3000:]}  # fmt: skip
    stage("done")
    result["stage_seconds"] = stage.times
    result["seconds"] = round(time.perf_counter() - started, 2)
    if ctx.violations:
        result = {"ok": False, "refusal": Refusal(kind="task_code", what="a sandbox violation",
                  detail="; ".join(ctx.violations)).model_dump()}  # fmt: skip
    return result


def _trace_at(
    source_path: Path, overrides: dict[str, int], class_name: str | None, *, meta: bool = True
) -> Any:
    module = torch_module.load_scaled(source_path, overrides)
    cls, get_inputs, get_init_inputs = torch_module.entry_points(module, class_name)
    model, inputs = torch_trace.build(cls, get_inputs, get_init_inputs, meta=meta)
    return torch_trace.trace(model, inputs, source_path)


def _convert(source_path: Path, payload: dict[str, Any], stage: Any, run_dir: Path) -> dict[str, Any]:
    from maxkernel.convert.torch_env import versions

    source = source_path.read_text()
    class_name = payload.get("class_name")
    constants = torch_module.scalable(torch_module.size_constants(source))
    stage("trace")
    try:
        own = _trace_at(source_path, {}, class_name)
    except LookupError as exc:
        raise ConversionRefused(
            Refusal(kind="entry_points", what="the task's entry points", detail=str(exc))
        ) from exc
    stage("scale")
    small, small_overrides, scale_note = _choose_cpu_scale(source_path, class_name, constants, own)
    programs = [own.program]
    third_overrides: dict[str, int] = {}
    if small is not None:
        programs.append(small.program)
        third, third_overrides = _third_scale(source_path, class_name, small_overrides, own)
        if third is not None:
            programs.append(third.program)
    stage("write")
    arg_names = own.input_names + own.state_names
    try:
        computation = SourceWriter(programs).write_function("computation", arg_names)
    except SizeNotFitted as exc:
        if program_bytes(own.program) > OWN_SCALE_LIMIT:
            raise ConversionRefused(Refusal(kind="sizes", what=str(exc))) from exc
        computation = SourceWriter([own.program]).write_function("computation", arg_names)
        small, small_overrides, third_overrides = None, {}, {}
        scale_note = f"validated at the file's own sizes: {exc}"
    except UnsupportedPrimitive as exc:
        raise ConversionRefused(
            Refusal(
                kind="jax_primitive",
                what=f"JAX primitive `{exc.primitive}`",
                where=exc.origin,
                detail=exc.detail,
            )  # fmt: skip
        ) from exc
    small_traced = small or own
    stage("recipes")
    recipes, specs = _recipes(source_path, class_name, small_overrides, own, small_traced, constants)
    out_dtypes = sorted({own.program.avals[r.var][1] for r in own.program.outs if r.var is not None})
    kernelbench = torch_module.is_kernelbench_source(source)
    tol = (
        KERNELBENCH_TOLERANCE
        if kernelbench
        else min(TASK_TOLERANCE.get(d, 1e-3) for d in out_dtypes or ["float32"])
    )
    reference = render_reference(source_path, own, recipes, specs, computation, versions(), kernelbench)
    ref_file = run_dir / "reference.py"
    ref_file.write_text(reference)
    stage("verify")
    checks, mismatch = _verify(
        ref_file, source_path, class_name, small_overrides, own, payload.get("draws", 3)
    )
    same = _same_program(ref_file, own)
    ok = same is None and mismatch is None
    refusal = None
    if same is not None:
        refusal = Refusal(kind="mismatch", what="the written reference's program", detail=same).model_dump()
    elif mismatch is not None:
        lines = list(dict.fromkeys(op.origin for op in own.program.ops if op.origin))
        prims = sorted({op.prim for op in own.program.ops} - BENIGN_PRIMITIVES)
        detail = f"{mismatch['detail']}; its ops come from {' | '.join(lines[:3]) or 'the model'} (JAX: {', '.join(prims[:8])})"
        refusal = Refusal(kind="mismatch", what=mismatch["what"], detail=detail).model_dump()
    return {
        "ok": ok,
        "refusal": refusal,
        "reference_source": reference,
        "kernelbench": kernelbench,
        "tolerance": tol,
        "checks": checks,
        "input_names": own.input_names,
        "state_names": own.state_names,
        "state_keys": own.state_keys,
        "static_args": [repr(s) for s in own.static_args],
        "scales": {
            "own": {k: v for k, v in constants.items()},
            "cpu": small_overrides,
            "fit": third_overrides,
        },
        "scale_note": scale_note,
        "own_bytes": program_bytes(own.program),
        "cpu_bytes": program_bytes(small_traced.program),
        "recipes": {n: r.model_dump() for n, r in recipes.items()},
        "versions": versions(),
        "outputs": own.outputs,
    }


def _choose_cpu_scale(
    source_path: Path, class_name: str | None, constants: dict[str, int], own: torch_trace.Traced
) -> tuple[torch_trace.Traced | None, dict[str, int], str]:
    """The largest shrink of the size constants that fits the CPU budget with the same program structure.
    None: the file's own sizes are the CPU scale."""
    fits = lambda p: program_bytes(p) <= CPU_BYTES and program_flops(p) <= CPU_FLOPS  # noqa: E731
    if fits(own.program):
        return None, {}, "the file's own sizes are small enough to validate on a CPU"
    if not constants:
        if program_bytes(own.program) <= OWN_SCALE_LIMIT:
            return None, {}, "no module-level size constants to shrink: validated at the file's own sizes"
        raise ConversionRefused(
            Refusal(kind="too_large", what=f"inputs of {program_bytes(own.program) / 2**20:.0f} MiB")
        )
    last: tuple[torch_trace.Traced, dict[str, int]] | None = None
    differences: list[str] = []
    seen: set[tuple[tuple[str, int], ...]] = set()
    for factor in SHRINK_FACTORS[1:]:
        overrides = {k: torch_module.shrink_value(v, factor) for k, v in constants.items()}
        overrides = {k: v for k, v in overrides.items() if v != constants[k]}
        key = tuple(sorted(overrides.items()))
        if not overrides or key in seen:
            continue
        seen.add(key)
        try:
            traced = _trace_at(source_path, overrides, class_name)
        except ConversionRefused as exc:
            differences.append(f"x{factor:g}: {exc.refusal.what}")
            continue
        except Exception as exc:  # noqa: BLE001 - the file runs at its own sizes; this shrink made it invalid
            # (a GroupNorm of 16 groups over 64 channels shrunk to 8): a smaller copy that cannot be built,
            # not a broken file
            differences.append(
                f"x{factor:g}: {type(exc).__name__} ({(str(exc).strip().splitlines() or [''])[0][:160]})"
            )
            continue
        diff = structure_difference(own.program, traced.program)
        if diff is not None:
            differences.append(f"x{factor:g}: {diff}")
            continue
        last = (traced, overrides)
        if fits(traced.program):
            return traced, overrides, f"size constants shrunk x{factor:g}"
    if last is not None:
        return (
            last[0],
            last[1],
            "the smallest shrink that keeps the program's structure (above the CPU budget)",
        )
    if program_bytes(own.program) <= OWN_SCALE_LIMIT:
        return None, {}, "no smaller copy keeps the program's structure: validated at the file's own sizes"
    raise ConversionRefused(Refusal(kind="scales", what="the model's program at smaller sizes",
                                    detail="; ".join(differences)[:400]))  # fmt: skip


def _third_scale(
    source_path: Path, class_name: str | None, small: dict[str, int], own: torch_trace.Traced
) -> tuple[torch_trace.Traced | None, dict[str, int]]:
    """A further scale, not proportional to the CPU one (every other constant doubled), to fit sizes on."""
    names = list(small)
    options = [
        {k: (v * 2 if i % 2 == 0 else v) for i, (k, v) in enumerate(small.items())},
        {k: (v * 2 if i % 2 == 1 else v) for i, (k, v) in enumerate(small.items())},
        {k: v * 2 for k, v in small.items()},
    ]
    for overrides in options:
        if not names or overrides == small:
            continue
        try:
            traced = _trace_at(source_path, overrides, class_name)
        except Exception:  # noqa: BLE001 - refused, or the sizes make the module invalid: try the next
            continue
        if structure_difference(own.program, traced.program) is None:
            return traced, overrides
    return None, {}


def _recipes(
    source_path: Path,
    class_name: str | None,
    overrides: dict[str, int],
    own: torch_trace.Traced,
    small: torch_trace.Traced,
    constants: dict[str, int],
) -> tuple[dict[str, input_recipes.Recipe], dict[str, dict[str, dict[str, Any]]]]:
    """A recipe per input and weight, from PyTorch's draws at the CPU scale; per scale, each array's
    shape and recipe parameters."""
    import torch

    module = torch_module.load_scaled(source_path, overrides)
    cls, get_inputs, get_init_inputs = torch_module.entry_points(module, class_name)
    samples: list[list[np.ndarray]] = []
    for seed in range(RECIPE_SEEDS):  # several draws: a 32-element bias is too few values to tell apart
        model, inputs = torch_trace.build(cls, get_inputs, get_init_inputs, meta=False, seed=seed)
        tensors = [a.detach().numpy() for a in inputs if isinstance(a, torch.Tensor)]
        samples.append(tensors + torch_trace.state_dict_arrays(model, small.state_keys))
    arrays = samples[0]
    pooled = [np.stack([s[i] for s in samples]) for i in range(len(arrays))]
    names = own.input_names + own.state_names
    small_shapes = [tuple(a.shape) for a in arrays]
    own_shapes = [own.program.avals[v][0] for v in own.program.invars]
    fan_ins_small = [input_recipes.fan_in(s) for s in small_shapes[len(tensors) :]]
    fan_ins_own = [input_recipes.fan_in(s) for s in own_shapes[len(tensors) :]]
    recipes: dict[str, input_recipes.Recipe] = {}
    specs: dict[str, dict[str, dict[str, Any]]] = {"tpu": {}, "cpu": {}}
    cpu_to_own = {overrides[k]: constants[k] for k in overrides}
    for i, (name, values) in enumerate(zip(names, pooled, strict=True)):
        fans = fan_ins_small if i >= len(tensors) else []
        dtype = own.program.avals[own.program.invars[i]][1]  # JAX's dtype (int64 is int32 without x64)
        recipe = input_recipes.recognise(np.asarray(values).astype(dtype), fans)
        recipes[name] = recipe
        own_fan = None
        if recipe.fan_in_bound:
            j = fans.index(recipe.params["fan_in"])
            own_fan = fan_ins_own[j]
        cpu_params = dict(recipe.params)
        own_params = input_recipes.at_scale(recipe, own_shapes[i], own_fan)
        if recipe.kind == "integers" and recipe.params["high"] in cpu_to_own:
            own_params["high"] = cpu_to_own[recipe.params["high"]]  # class labels follow the class count
        specs["cpu"][name] = {"shape": small_shapes[i], **cpu_params}
        specs["tpu"][name] = {"shape": tuple(own_shapes[i]), **own_params}
    return recipes, specs


def render_reference(
    source_path: Path,
    own: torch_trace.Traced,
    recipes: dict[str, input_recipes.Recipe],
    specs: dict[str, dict[str, dict[str, Any]]],
    computation: str,
    versions: dict[str, str],
    kernelbench: bool,
) -> str:
    names = own.input_names + own.state_names
    n_inputs = len(own.input_names)
    origin = "a KernelBench task" if kernelbench else "a PyTorch module"
    lines = [
        f'"""{source_path.name}: {origin}, converted to JAX by `maxkernel convert`.',
        "",
        f"Traced with torchax {versions.get('torchax')} (PyTorch {versions.get('torch')}, JAX {versions.get('jax')})"
        " and written back as plain JAX;",
        "verified against PyTorch on the same inputs and weights (see conversion.json next to this file).",
        f"Arguments: the forward's inputs ({', '.join(own.input_names) or 'none'}), then the module's parameters",
        f"and buffers ({', '.join(own.state_names) or 'none'}). Sizes: scale='tpu' is the file's own, scale='cpu'",
        "a smaller copy for correctness runs on a CPU.",
        '"""',
        "",
        "import jax",
        "import jax.numpy as jnp",
        "from jax import lax",
        "",
        "# Per scale: each array's shape and the parameters of the distribution it is drawn from.",
        "SPECS = {",
    ]
    for scale in ("tpu", "cpu"):
        lines.append(f"    {scale!r}: {{")
        for name in names:
            lines.append(f"        {name!r}: {_literal(specs[scale][name])},")
        lines.append("    },")
    lines += [
        "}",
        "",
        "",
        'def get_inputs(scale="tpu", seed=0):',
        '    """The forward\'s inputs and the module\'s weights, drawn as PyTorch draws them (recipes read off',
        '    PyTorch\'s own draws). Returns (dynamic_args, static_args)."""',
        "    spec = SPECS[scale]",
        f"    keys = jax.random.split(jax.random.key(seed), {max(1, len(names))})",
    ]
    for i, name in enumerate(names):
        lines.append("    " + input_recipes.draw_code(name, recipes[name], f"keys[{i}]", f'spec["{name}"]'))
    lines.append(f"    return [{', '.join(names)}], []")
    lines += ["", ""]
    doc = f"The forward of {source_path.name}'s model: {n_inputs} input(s), then {len(names) - n_inputs} weight(s)."
    body = computation.replace(
        computation.splitlines()[0] + "\n", computation.splitlines()[0] + f'\n    """{doc}"""\n', 1
    )
    lines.append(body.rstrip("\n"))
    return "\n".join(lines) + "\n"


def _literal(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return repr(float(f"{value:.9g}"))
    if isinstance(value, tuple | list):
        inner = ", ".join(_literal(v) for v in value)
        return f"({inner}{',' if len(value) == 1 else ''})" if isinstance(value, tuple) else f"[{inner}]"
    return repr(value)


def _load_reference(ref_file: Path) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("maxkernel_converted_reference", ref_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _same_program(ref_file: Path, own: torch_trace.Traced) -> str | None:
    """None when the written reference, traced at the file's own sizes, is torchax's program."""
    import jax

    ref = _load_reference(ref_file)
    specs = [jax.ShapeDtypeStruct(*own.program.avals[v]) for v in own.program.invars]
    written = flatten_closed(jax.make_jaxpr(ref.computation)(*specs))
    diff = structure_difference(own.program, written)
    if diff is not None:
        return f"at the file's own sizes it differs from the traced program: {diff}"
    for a, b in zip(own.program.ops, written.ops, strict=True):
        for key in a.params:
            if repr(a.params[key]) != repr(b.params[key]):
                return f"{a.prim} parameter {key}: {a.params[key]!r} written as {b.params[key]!r}"
    return None


def compare(expected: np.ndarray, got: np.ndarray, dtype: str) -> dict[str, Any]:
    atol, rtol = CHECK_TOLERANCE.get(dtype, (1e-4, 1e-4))
    if expected.shape != got.shape:
        return {"ok": False, "detail": f"shape {got.shape} vs PyTorch's {expected.shape}"}
    e = expected.astype(np.float64)
    g = got.astype(np.float64)
    nan_same = bool(np.array_equal(np.isnan(e), np.isnan(g)))
    finite = np.isfinite(e) & np.isfinite(g)
    diff = np.abs(e - g)[finite]
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = np.abs(e)[finite]
    max_rel = float((diff / np.maximum(scale, 1e-30)).max()) if diff.size else 0.0
    inf_same = bool(np.array_equal(np.where(np.isinf(e), e, 0), np.where(np.isinf(g), g, 0)))
    ok = nan_same and inf_same and bool(np.all(diff <= atol + rtol * scale))
    return {"ok": ok, "max_abs_err": max_abs, "max_rel_err": max_rel, "atol": atol, "rtol": rtol,
            **({} if nan_same else {"detail": "NaNs in different places"})}  # fmt: skip


def _verify(
    ref_file: Path, source_path: Path, class_name: str | None, overrides: dict[str, int],
    own: torch_trace.Traced, draws: int,
) -> tuple[list[dict[str, Any]], dict[str, str] | None]:  # fmt: skip
    """PyTorch vs the written reference at the CPU scale: `draws` of PyTorch's own inputs and weights, and
    `draws` of the reference's `get_inputs`. Returns the checks and the first mismatch (None: all agree)."""
    import jax
    import torch

    ref = _load_reference(ref_file)
    computation = jax.jit(ref.computation)
    module = torch_module.load_scaled(source_path, overrides)
    cls, get_inputs, get_init_inputs = torch_module.entry_points(module, class_name)
    n_in = len(own.input_names)
    checks: list[dict[str, Any]] = []
    mismatch: dict[str, str] | None = None
    for origin in ("pytorch", "reference"):
        for seed in range(draws):
            model, inputs = torch_trace.build(cls, get_inputs, get_init_inputs, meta=False, seed=seed)
            if origin == "reference":
                dynamic, _static = ref.get_inputs(scale="cpu", seed=seed)
                arrays = [np.asarray(a) for a in dynamic]
                torch_trace.load_state(model, own.state_keys, arrays[n_in:])
                it = iter(
                    arrays[:n_in]
                )  # in PyTorch's own dtypes (int64 labels are int32 in JAX without x64)
                inputs = [
                    torch.from_numpy(np.array(next(it))).to(a.dtype) if isinstance(a, torch.Tensor) else a
                    for a in inputs
                ]
            else:
                tensors = [a.detach().numpy() for a in inputs if isinstance(a, torch.Tensor)]
                arrays = tensors + torch_trace.state_dict_arrays(model, own.state_keys)
            with torch.no_grad():
                out = model(*inputs)
            expected = [t.detach().numpy() for t in (out if isinstance(out, tuple | list) else [out])]
            got = [np.asarray(g) for g in jax.tree_util.tree_leaves(computation(*arrays))]
            for k, (e, g) in enumerate(zip(expected, got, strict=True)):
                c = compare(e, g, str(e.dtype))
                checks.append({"draw": f"{origin} seed {seed}", "output": k, **c})
                if not c["ok"] and mismatch is None:
                    mismatch = {
                        "what": f"output {k}",
                        "detail": f"on {origin} draw {seed}: "
                        + c.get(
                            "detail",
                            f"max abs err {c['max_abs_err']:.3g}, max rel err {c['max_rel_err']:.3g}",
                        ),
                    }
    return checks, mismatch
