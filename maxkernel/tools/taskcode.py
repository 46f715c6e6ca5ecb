"""Worker-side task code: load a task's reference and build its inputs. Runs only inside the sandbox.

Three task formats are read as they are:

* MaxKernel problem dir: `reference.py` (`computation`, usually `get_inputs`) + `kernel_task.yaml`
  (`task_id`, `description`, `input_gen_code`, `atol`, `rtol`). `get_inputs(dtype=...)` returns
  `(dynamic_args, static_args)` or a list of such pairs (several input configurations).
* A bare `reference.py` with `get_inputs` and `computation`.
* A JAXBench workload (`benchmark/<id>/baseline.py`, or any module with them): `CONFIG`,
  `create_inputs(dtype=...)`, `workload(*inputs)`. Candidates may export `workload` instead of
  `computation` (JAXBench's hand-written `optimized.py` kernels do).

If `get_inputs` accepts a `scale` keyword (this project's suite does), `scale="cpu"` gives the small shapes
used for correctness in interpret mode and `scale="tpu"` the production shapes.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import math
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from maxkernel.tools import generator_knobs
from maxkernel.tools.results import ArraySpec


class TaskCodeError(Exception):
    """The task itself is broken (not the candidate): exit code 2 territory."""


def load_module(path: Path, name: str, text: str | None = None) -> types.ModuleType:
    """Import `path` as module `name`; with `text`, that source instead of the file's (a task whose
    generator knobs were changed), still under the file's name so tracebacks point at it."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TaskCodeError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # Let the module import siblings (helpers next to reference.py).
    sys.path.insert(0, str(path.parent))
    try:
        if text is None:
            spec.loader.exec_module(module)
        else:
            exec(compile(text, str(path), "exec"), module.__dict__)
    finally:
        sys.path.remove(str(path.parent))
    return module


SOURCE_FIELDS: tuple[str, ...] = ("format", "reference_path", "input_gen_code")
"""What `Reference` needs to load a task's code: the one definition of a task's "source"."""


def task_source(task: dict[str, Any]) -> dict[str, Any]:
    """The source fields of a task dict (a `KernelTask` dump, or the loader's own fields)."""
    return {k: task.get(k) for k in SOURCE_FIELDS}


GENERATORS = {"jaxbench": "create_inputs"}
"""The input generator's name per format (`get_inputs` elsewhere)."""

JAXBENCH_DTYPE = "bfloat16"
"""JAXBench's own runner calls `create_inputs(dtype=jnp.bfloat16)` whenever the generator takes a `dtype`
(its f32-default KernelBench workloads included); a workload is loaded as that runner loads it."""


def _knob_texts(source: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Where a task's generator knobs live: `where` -> (text, generator name)."""
    fmt = source["format"]
    generator = GENERATORS.get(fmt, "get_inputs")
    ref_path = Path(source["reference_path"])
    try:
        text = ref_path.read_text()
    except OSError:
        return {}
    out = {}
    if fmt == "jaxbench" or f"def {generator}" in text or not source.get("input_gen_code"):
        out[generator_knobs.MODULE] = (text, generator)
    else:
        out[generator_knobs.INPUT_GEN_CODE] = (str(source["input_gen_code"]), generator)
    return out


def find_task_knobs(source: dict[str, Any]) -> list[generator_knobs.Knob]:
    """The size knobs of a task's generator (see `generator_knobs`)."""
    return [
        knob
        for where, (text, generator) in _knob_texts(source).items()
        for knob in generator_knobs.find_knobs(text, where, generator)
    ]


def _with_knobs(source: dict[str, Any], knobs: dict[str, int]) -> dict[str, str]:
    """The texts of a task's code with `knobs` applied, per `where`."""
    out = {}
    for where, (text, generator) in _knob_texts(source).items():
        mine = {k: v for k, v in knobs.items() if k.startswith(where + ":")}
        if mine:
            out[where] = generator_knobs.apply(text, generator_knobs.find_knobs(text, where, generator), mine)
    if len(out) != len({k.split(":", 1)[0] for k in knobs}):
        raise TaskCodeError(f"the task's generator has no knobs {sorted(knobs)}")
    return out


class Reference:
    """The task's reference: how to make inputs, and the computation itself.

    `knobs` (generator literal -> value, see `generator_knobs`) loads the task's code with those literals
    changed: the validation sizes of a task without CPU-scale inputs."""

    @classmethod
    def of_task(cls, task: dict[str, Any]) -> Reference:
        return cls(task_source(task))

    def __init__(self, source: dict[str, Any], knobs: dict[str, int] | None = None) -> None:
        self.format: str = source["format"]
        self.source = source
        self.knobs = dict(knobs or {})
        ref_path = Path(source["reference_path"])
        texts = _with_knobs(source, self.knobs) if self.knobs else {}
        name = "maxkernel_reference" + (
            f"_{abs(hash(tuple(sorted(self.knobs.items()))))}" if self.knobs else ""
        )
        try:
            self.module = load_module(ref_path, name, texts.get(generator_knobs.MODULE))
        except TaskCodeError:
            raise
        except SyntaxError as exc:
            raise TaskCodeError(f"syntax error in {ref_path.name} line {exc.lineno}: {exc.msg}") from exc
        except Exception as exc:
            raise TaskCodeError(f"importing {ref_path.name} failed: {type(exc).__name__}: {exc}") from exc
        m = self.module
        self.skip_jit = bool(getattr(m, "_skip_jit", False))
        if self.format == "jaxbench":
            if not callable(getattr(m, "workload", None)) or not callable(getattr(m, "create_inputs", None)):
                raise TaskCodeError(
                    f"{ref_path.name}: a JAXBench workload needs `create_inputs` and `workload`"
                )
            self._get_inputs = _jaxbench_generator(m.create_inputs)
            self.computation: Callable[..., Any] = (
                m.workload if self.knobs else config_follows_shapes(m, m.workload, self._get_inputs)
            )
        else:
            if not callable(getattr(m, "computation", None)):
                raise TaskCodeError(f"{ref_path.name} has no function `computation`")
            self.computation = m.computation
            get_inputs = getattr(m, "get_inputs", None)
            code = texts.get(generator_knobs.INPUT_GEN_CODE, source.get("input_gen_code"))
            if get_inputs is None and code:
                namespace: dict[str, Any] = {}
                try:
                    exec(compile(code, "kernel_task.yaml:input_gen_code", "exec"), namespace)
                except SyntaxError as exc:
                    raise TaskCodeError(
                        f"syntax error in input_gen_code line {exc.lineno}: {exc.msg}"
                    ) from exc
                except Exception as exc:
                    raise TaskCodeError(f"input_gen_code failed: {type(exc).__name__}: {exc}") from exc
                get_inputs = namespace.get("get_inputs")
            if not callable(get_inputs):
                raise TaskCodeError(
                    f"{ref_path.name} has no `get_inputs` (and the task yaml has no input_gen_code)"
                )
            self._get_inputs = get_inputs
        try:
            self.accepts_scale = "scale" in inspect.signature(self._get_inputs).parameters
        except (TypeError, ValueError):
            self.accepts_scale = False

    def raw_inputs(self, scale: str | None = None) -> list[tuple[list[Any], list[Any]]]:
        """Call the task's input generator; normalise to a list of (dynamic, static) configurations."""
        kwargs = {"scale": scale} if (scale and self.accepts_scale) else {}
        try:
            produced = self._get_inputs(**kwargs)
        except Exception as exc:
            raise TaskCodeError(f"get_inputs raised {type(exc).__name__}: {exc}") from exc
        return normalise_inputs(produced, self.format)


_REFERENCES: dict[tuple[str, ...], Reference] = {}

OWN_INPUT_MODES = ("task", "cpu", "knobs")
"""Validation modes whose first input set is the task's own (its generator ran at those sizes); in the
other mode ("shrink") every set is drawn from the statistics of the task's full-size inputs."""


def reference_for(source: dict[str, Any], knobs: dict[str, int] | None) -> Reference:
    """A `Reference` per (task, knob setting), loaded once per process (a judge reads several configs)."""
    key = (json.dumps(source, sort_keys=True, default=str), json.dumps(knobs or {}, sort_keys=True))
    if key not in _REFERENCES:
        _REFERENCES[key] = Reference(source, knobs)
    return _REFERENCES[key]


def own_validation_inputs(source: dict[str, Any], task: dict[str, Any]) -> list[list[np.ndarray]]:
    """The task's own inputs at every validation config (a mode in `OWN_INPUT_MODES`), as numpy: its
    generator run once per knob setting (its CPU scale in mode "cpu")."""
    mode = task["validation_mode"]
    out: list[list[np.ndarray]] = []
    made: dict[str, list[tuple[list[Any], list[Any]]]] = {}
    for index, cfg in enumerate(task["validation_configs"]):
        knobs = (cfg.get("knobs") if isinstance(cfg, dict) else getattr(cfg, "knobs", None)) or {}
        key = json.dumps(knobs, sort_keys=True)
        if key not in made:
            ref = reference_for(source, knobs or None)
            made[key] = ref.raw_inputs("cpu" if mode == "cpu" else ("tpu" if ref.accepts_scale else None))
        out.append([to_numpy(a) for a in made[key][index][0]])
    return out


def _jaxbench_generator(create_inputs: Callable[..., Any]) -> Callable[..., Any]:
    """`create_inputs` as JAXBench's runner calls it: `dtype=jnp.bfloat16` when it takes a dtype."""
    try:
        takes_dtype = "dtype" in inspect.signature(create_inputs).parameters
    except (TypeError, ValueError):
        takes_dtype = False

    @functools.wraps(create_inputs)
    def generate() -> Any:
        if takes_dtype:
            import jax.numpy as jnp

            return create_inputs(dtype=getattr(jnp, JAXBENCH_DTYPE))
        return create_inputs()

    return generate


# What a candidate module may export, in order of preference: our own name, then JAXBench's.
CANDIDATE_ENTRY_POINTS = ("computation", "workload")


def candidate_entry(module: types.ModuleType) -> Callable[..., Any] | None:
    """The candidate's function: `computation`, or `workload` (a JAXBench hand-written kernel).

    A hand-written `workload` may declare fewer arguments than the baseline's: JAXBench's runner calls it
    with its own module's `create_inputs`, which can leave out what the kernel does not need (a static
    group size, trailing cumulative lengths). It gets the leading arguments it declares.

    Such a kernel also reads sizes from its own module's `CONFIG` (`x.reshape(CONFIG["batch"], ...)`), a copy
    the validation sizing does not rewrite: with a `CONFIG` dict and a `create_inputs` of its own, those
    sizes follow the inputs' shapes while it runs at other shapes (`config_follows_shapes`), as the task's
    reference does. At the workload's own shapes nothing changes."""
    for name in CANDIDATE_ENTRY_POINTS:
        fn = getattr(module, name, None)
        if callable(fn):
            if name != "workload":
                return fn
            create = getattr(module, "create_inputs", None)
            if isinstance(getattr(module, "CONFIG", None), dict) and callable(create):
                fn = config_follows_shapes(module, fn, create)
            return _leading_arguments(fn)
    return None


def _leading_arguments(fn: Callable[..., Any]) -> Callable[..., Any]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return fn
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.KEYWORD_ONLY) for p in params):
        return fn
    n = len(params)

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        return fn(*args[:n])

    return call


def config_follows_shapes(
    module: types.ModuleType, workload: Callable[..., Any], create_inputs: Callable[..., Any]
) -> Callable[..., Any]:
    """Wrap a JAXBench `workload` so that, while it runs (or traces) at shapes other than the workload's
    own, the integers in its module's `CONFIG` that name a changed dimension follow the inputs.

    JAXBench workloads often read sizes from `CONFIG` (`x.reshape(CONFIG["seq_len"], ...)`), which would
    make them untraceable at shrunk validation shapes. The map from own to actual sizes is taken dimension
    by dimension from the inputs; a size that maps two ways is left alone, as are non-integer entries. At
    the workload's own shapes nothing changes.
    """
    own_shapes: list[tuple[int, ...]] = []

    def own() -> list[tuple[int, ...]]:
        if not own_shapes:
            import jax

            produced = jax.eval_shape(lambda: normalise_inputs(create_inputs(), "jaxbench")[0][0])
            own_shapes.extend(tuple(int(d) for d in a.shape) for a in produced)
        return own_shapes

    @functools.wraps(workload)
    def run(*inputs: Any) -> Any:
        config = getattr(module, "CONFIG", None)
        if not isinstance(config, dict):
            return workload(*inputs)
        mapping: dict[int, int] = {}
        clashes: set[int] = set()
        for before, arg in zip(own(), inputs, strict=False):
            after = tuple(int(d) for d in getattr(arg, "shape", ()))
            if len(after) != len(before):
                continue
            for b, a in zip(before, after, strict=True):
                if b != a:
                    if mapping.get(b, a) != a:
                        clashes.add(b)
                    mapping[b] = a
        for b in clashes:
            mapping.pop(b, None)
        if not mapping:
            return workload(*inputs)
        saved = dict(config)
        for key, value in saved.items():
            if isinstance(value, int) and not isinstance(value, bool) and value in mapping:
                config[key] = mapping[value]
        try:
            return workload(*inputs)
        finally:
            config.clear()
            config.update(saved)

    return run


def normalise_inputs(produced: Any, fmt: str) -> list[tuple[list[Any], list[Any]]]:
    if fmt == "jaxbench":
        # As JAXBench's runner: the generator's values are the workload's arguments, in order. Values that are
        # not arrays (a Python int used as a static size, a float, a tuple) are static arguments: maxkernel
        # passes them after the arrays, so they must come last.
        values = list(produced) if isinstance(produced, list | tuple) else [produced]
        first_static = next((i for i, v in enumerate(values) if not _is_array(v)), len(values))
        late = [i for i, v in enumerate(values) if i > first_static and _is_array(v)]
        if late:
            raise TaskCodeError(
                f"create_inputs returns a non-array value at position {first_static} before the array at "
                f"position {late[0]}; static values (Python ints, floats, tuples) are passed after the arrays, "
                "so return them last"
            )
        return [(values[:first_static], values[first_static:])]
    if _is_pair(produced):
        return [(list(produced[0]), list(produced[1]))]
    if isinstance(produced, list) and produced and all(_is_pair(p) for p in produced):
        return [(list(d), list(s)) for d, s in produced]
    raise TaskCodeError(
        "get_inputs must return (dynamic_args, static_args) or a list of such pairs; "
        f"got {type(produced).__name__}"
    )


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _is_pair(x: Any) -> bool:
    return (
        isinstance(x, tuple | list)
        and len(x) == 2
        and isinstance(x[0], list | tuple)
        and isinstance(x[1], list | tuple)
        and all(hasattr(a, "shape") for a in x[0])
    )


def spec_of(x: Any) -> ArraySpec:
    return ArraySpec(shape=tuple(int(d) for d in x.shape), dtype=str(np.dtype(x.dtype)))


_CONCRETE_ERRORS = (
    "ConcretizationTypeError",
    "TracerIntegerConversionError",
    "TracerBoolConversionError",
    "TracerArrayConversionError",
)
"""What a generator raises under abstract evaluation when it needs a concrete value (a static computed with
`jnp`: `float(1.0 / jnp.sqrt(head_dim))`)."""


def _needs_concrete(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if type(seen).__name__ in _CONCRETE_ERRORS:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def abstract_inputs(ref: Reference, scale: str | None) -> list[tuple[list[ArraySpec], list[Any]]]:
    """Shapes and dtypes of the inputs, without allocating them (`jax.eval_shape`) where the generator
    allows it. A generator that needs concrete values to compute its statics is run as its own harness runs
    it: concretely, on the CPU (its arrays are allocated once, then dropped)."""
    import jax

    statics: list[list[Any]] = []

    def dynamic_only() -> list[list[Any]]:
        configs = ref.raw_inputs(scale)
        statics.extend(s for _, s in configs)
        return [d for d, _ in configs]

    try:
        shapes = jax.eval_shape(dynamic_only)
    except Exception as exc:
        if not _needs_concrete(exc):
            if isinstance(exc, TaskCodeError):
                raise
            raise TaskCodeError(
                f"get_inputs could not be traced abstractly: {type(exc).__name__}: {exc}"
            ) from exc
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            concrete = ref.raw_inputs(scale)
        return [([spec_of(a) for a in dyn], list(st)) for dyn, st in concrete]
    return [([spec_of(a) for a in dyn], list(st)) for dyn, st in zip(shapes, statics, strict=True)]


SMALL_INT_ELEMENTS = 1 << 16
"""Integer inputs up to this size (group sizes, sequence lengths, page tables) are read by value for the
block model (the estimator propagates known arrays up to `estimate.MAX_KNOWN_ELEMENTS`, the same size): a
32 x 256 page table left out made it price every paged K/V block as a fresh copy, past the lengths too."""


def small_int_inputs(ref: Reference, scale: str | None) -> list[dict[int, Any]]:
    """Per configuration, the values of the small integer dynamic inputs at `scale` (position -> nested list).

    Computed under `jax.jit`, so the large arrays the generator also makes are dead code that XLA never
    computes: reading a grouped matmul's group sizes at production scale costs a compile, not gigabytes.
    A generator that cannot be jitted gives nothing (the block model then prices an upper bound)."""
    import jax
    import jax.numpy as jnp

    def small_only() -> list[list[Any]]:
        return [
            [
                a
                if jnp.issubdtype(a.dtype, jnp.integer) and int(np.prod(a.shape)) <= SMALL_INT_ELEMENTS
                else None
                for a in dyn
            ]
            for dyn, _ in ref.raw_inputs(scale)
        ]

    try:
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            configs = jax.jit(small_only)()
    except Exception:  # noqa: BLE001 - values are an optional refinement of the estimate
        return []
    return [{i: np.asarray(a).tolist() for i, a in enumerate(dyn) if a is not None} for dyn in configs]


def integer_maxima(
    ref: Reference, configs: list[tuple[list[ArraySpec], list[Any]]]
) -> tuple[int | None, ...]:
    """The largest value of each integer dynamic input (None for the others), all configurations in order.
    Computed under `jax.jit` like `small_int_inputs`: the float arrays are dead code XLA never makes."""
    import jax
    import jax.numpy as jnp

    if not any(not a.dtype.startswith(("float", "bfloat", "bool")) for dyn, _ in configs for a in dyn):
        return tuple(None for dyn, _ in configs for _a in dyn)

    def maxima() -> list[Any]:
        return [
            jnp.max(a) if jnp.issubdtype(a.dtype, jnp.integer) and a.size else None
            for dyn, _ in ref.raw_inputs(None)
            for a in dyn
        ]

    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        values = jax.jit(maxima)()
    return tuple(None if v is None else int(v) for v in values)


def output_specs(ref: Reference, dynamic: list[ArraySpec], static: list[Any]) -> list[ArraySpec]:
    import jax

    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in dynamic]
    try:
        out = jax.eval_shape(lambda *d: ref.computation(*d, *static), *args)
    except Exception as exc:
        raise TaskCodeError(
            f"the reference computation failed to trace: {type(exc).__name__}: {exc}"
        ) from exc
    return [spec_of(leaf) for leaf in jax.tree_util.tree_leaves(out)]


# --- shrinking shapes for CPU validation ------------------------------------------------------------------


# The finest granularity a shrunk dimension keeps, per task format. 128 keeps lane/sublane tile multiples.
# JAXBench workloads come with hand-written kernels tuned at their real shapes (blocks up to 2048 wide), so
# their dims keep every power of two up to 2048 that divided them: a block that divided the real dim still
# divides the shrunk one, and the hand-written kernel is judged on its numerics, not on a broken grid.
TILE_MULTIPLE = 128
SHRINK_KEEP_MULTIPLE: dict[str, int] = {
    "maxkernel": TILE_MULTIPLE,
    "reference": TILE_MULTIPLE,
    "jaxbench": 2048,
}


# `--scale cpu` shrinks a task with no CPU-scale inputs by this factor; SHRINK_KEEP_MULTIPLE is for it.
CPU_SHRINK_FACTOR = 0.25


def _pow2_part(d: int) -> int:
    return d & -d


def keep_multiple_for(fmt: str, factor: float) -> int:
    """The multiple a format's shrunk dims keep at `factor`: the table's value at `--scale cpu`, scaled with
    the factor below it (a smaller requested size cannot hold 2048-wide blocks), never under 128."""
    base = SHRINK_KEEP_MULTIPLE.get(fmt, TILE_MULTIPLE)
    scaled = int(base * min(1.0, factor / CPU_SHRINK_FACTOR))
    keep = TILE_MULTIPLE
    while keep * 2 <= scaled:
        keep *= 2
    return min(base, keep)


def shrink_dim(d: int, factor: float, keep_multiple: int = TILE_MULTIPLE) -> int:
    """Shrink one dimension, keeping TPU tile multiples: a 128-multiple stays a multiple of the largest power
    of two that divides it, capped at `keep_multiple` (128 by default: lanes stay 128-multiples); an
    8-multiple stays an 8-multiple. Dimensions under 256 are left alone (heads, head_dim, batch and the like).
    """
    if d < 256 or factor >= 1:
        return d
    target = d * factor
    if d % TILE_MULTIPLE == 0:
        grain = max(TILE_MULTIPLE, min(_pow2_part(d), keep_multiple))
        return max(grain, int(math.floor(target / grain)) * grain)
    if d % 8 == 0:
        return max(8, int(math.floor(target / 8)) * 8)
    return max(1, int(round(target)))


def shrink_map(
    configs: list[tuple[list[ArraySpec], list[Any]]], factor: float, keep_multiple: int = TILE_MULTIPLE
) -> dict[int, int]:
    """One consistent old→new size map for every dimension seen, so equal dims stay equal (K of x and w)."""
    sizes = {d for dyn, _ in configs for a in dyn for d in a.shape}
    shrunk = {d: shrink_dim(d, factor, keep_multiple) for d in sizes}
    return {d: n for d, n in shrunk.items() if n != d}


def shrink_config(
    dynamic: list[ArraySpec], static: list[Any], mapping: dict[int, int]
) -> tuple[list[ArraySpec], list[Any]]:
    new_dyn = [ArraySpec(shape=tuple(mapping.get(d, d) for d in a.shape), dtype=a.dtype) for a in dynamic]
    # A static int equal to a shrunk dimension is almost always that dimension (seq_len, vocab, ...).
    new_static = [mapping.get(s, s) if isinstance(s, int) and not isinstance(s, bool) else s for s in static]
    return new_dyn, new_static


# --- growing shapes for the larger-shape check ------------------------------------------------------------

# The harness checks the candidate once more at the validation shapes grown by this factor (never past the
# task's own shapes): a kernel correct only at the validation size is caught there.
LARGER_SHAPE_FACTOR = 2


def grow_dim(d: int, ceiling: int, factor: int = LARGER_SHAPE_FACTOR) -> int:
    """`d` times `factor`, keeping its tile multiple (128, else 8), never past `ceiling` (the task's own size)."""
    if ceiling <= d:
        return d
    grain = TILE_MULTIPLE if d % TILE_MULTIPLE == 0 else 8 if d % 8 == 0 else 1
    grown = min(d * factor, ceiling) // grain * grain
    return max(d, grown)


def larger_map(val: list[ArraySpec], own: list[ArraySpec]) -> dict[int, int] | None:
    """One consistent old→new size map from a validation config towards the task's own config, each
    dimension grown by `grow_dim` (equal dims stay equal, as in `shrink_map`). None when the two configs do
    not pair up array by array and axis by axis; empty when nothing can grow."""
    if len(val) != len(own) or any(len(a.shape) != len(b.shape) for a, b in zip(val, own, strict=True)):
        return None
    mapping: dict[int, int] = {}
    for a, b in zip(val, own, strict=True):
        for d, ceiling in zip(a.shape, b.shape, strict=True):
            grown = grow_dim(d, ceiling)
            mapping[d] = min(mapping.get(d, grown), grown)  # a size shared with a smaller axis grows less
    return {d: n for d, n in mapping.items() if n != d}


# --- input sets -------------------------------------------------------------------------------------------


WIDE_SPREAD = 3.0
"""The wide draw family's spread, in standard deviations of the task's own values: far enough outside the
public sample (|x| > 4 for standard normal inputs in about a fifth of the elements) that a kernel that is
right only inside the sample's range is caught, not so far that a faithful kernel leaves the tolerance."""
SPECIAL_FRACTION = 0.01
"""Share of a wide draw's elements replaced by special values (zeros, signed ones, twice the extremes)."""

Domain = tuple[float, float]


def _clip(draw: np.ndarray, domain: Domain | None) -> np.ndarray:
    return draw if domain is None else np.clip(draw, domain[0], domain[1])


def _wide(shape: tuple[int, ...], rng: np.random.Generator, stats: dict[str, float],
          domain: Domain | None) -> np.ndarray:  # fmt: skip
    """A float draw wider than the sample: scaled and shifted about its mean, with special values."""
    mean, std = float(stats.get("mean", 0.0)), float(stats.get("std", 1.0)) or 1.0
    lo, hi = float(stats.get("min", mean - std)), float(stats.get("max", mean + std))
    shift = float(rng.choice([-1.0, 0.0, 1.0])) * std
    draw = rng.normal(mean + shift, WIDE_SPREAD * std, size=shape)
    specials = np.array([0.0, -0.0, 1.0, -1.0, 2.0 * lo, 2.0 * hi, mean])
    if domain is not None:
        specials = specials[(specials >= domain[0]) & (specials <= domain[1])]
    if draw.size and specials.size:
        mask = rng.random(shape) < SPECIAL_FRACTION
        draw = np.where(mask, rng.choice(specials, size=shape), draw)
    return _clip(draw, domain)


def random_like(
    x: np.ndarray, rng: np.random.Generator, hold: bool = False, *, wide: bool = False,
    domain: Domain | None = None,
) -> np.ndarray:  # fmt: skip
    """A fresh input with the same shape and dtype and similar values.

    Floats: normal draws with the observed mean and spread, clipped to the observed range (keeps positive
    inputs positive); with `wide`, scaled and shifted well past that range, with special values sprinkled in
    (`_wide`); always within the task's declared `domain` when it has one. Integers and booleans: a random
    permutation of the observed values, which stays in range and keeps sums and multisets (group sizes,
    page tables, labels) valid.
    """
    if hold or x.size == 0:
        return x.copy()
    if np.issubdtype(x.dtype, np.floating) or x.dtype.name == "bfloat16":
        xf = x.astype(np.float64)
        lo, hi = float(xf.min()), float(xf.max())
        mean, std = float(xf.mean()), float(xf.std())
        if std == 0.0:
            return x.copy()
        if wide:
            return _wide(x.shape, rng, {"mean": mean, "std": std, "min": lo, "max": hi}, domain).astype(
                x.dtype
            )
        draw = np.clip(rng.normal(mean, std, size=x.shape), lo, hi)
        return _clip(draw, domain).astype(x.dtype)
    flat = x.reshape(-1).copy()
    rng.shuffle(flat)
    return flat.reshape(x.shape)


def random_from_spec(
    spec: ArraySpec, rng: np.random.Generator, stats: dict[str, float], *, wide: bool = False,
    domain: Domain | None = None,
) -> np.ndarray:  # fmt: skip
    """Inputs for shrunk shapes, where the task's own values do not exist: drawn from observed statistics
    (`wide`: the wide family, as `random_like`)."""
    dtype = np.dtype(spec.dtype) if spec.dtype != "bfloat16" else None
    if spec.dtype == "bool":
        return rng.random(spec.shape) < stats.get("mean", 0.5)
    if dtype is not None and np.issubdtype(dtype, np.integer):
        return rng.integers(int(stats["min"]), int(stats["max"]) + 1, size=spec.shape).astype(dtype)
    import ml_dtypes

    std = stats.get("std", 1.0) or 1.0
    if wide:
        draw = _wide(tuple(spec.shape), rng, stats, domain)
    else:
        draw = _clip(np.clip(rng.normal(stats.get("mean", 0.0), std, size=spec.shape), stats["min"], stats["max"]),
                     domain)  # fmt: skip
    return draw.astype(ml_dtypes.bfloat16 if dtype is None else dtype)


def input_domains(task: dict[str, Any], n_inputs: int) -> list[Domain | None]:
    """Per dynamic input, the task's declared input domain (`input_domain` in kernel_task.yaml: one
    `[lo, hi]` for every floating input, or a mapping from input index to `[lo, hi]`); None where none."""
    raw = task.get("input_domain")
    if raw is None:
        return [None] * n_inputs
    if isinstance(raw, dict):
        return [_domain(raw.get(i, raw.get(str(i)))) for i in range(n_inputs)]
    return [_domain(raw)] * n_inputs


def _domain(value: Any) -> Domain | None:
    if value is None:
        return None
    lo, hi = (float(v) for v in value)
    return (lo, hi)


def to_numpy(x: Any) -> np.ndarray:
    return np.asarray(x)
