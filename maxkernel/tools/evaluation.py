"""Worker-side jobs: describe a task, evaluate a candidate. Runs only inside the sandbox.

Order matters for trust: the reference's outputs for every input set are computed *before* the candidate
module is imported, so nothing the candidate does at import or trace time can change what it is compared
against. The jaxpr that is checked for "Pallas does the work" is the very trace that is lowered and run.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from maxkernel.tools import taskcode
from maxkernel.tools.checks import check_pallas_does_work
from maxkernel.tools.results import (
    ArraySpec,
    CompileOutcome,
    CorrectnessResult,
    EstimateSummary,
    EvalResult,
    InputConfig,
    MeasuredTiming,
    SetCheck,
    StageError,
    np_dtype,
)
from maxkernel.tools.worker import WorkerContext

# --- describe ---------------------------------------------------------------------------------------------


def describe_job(payload: dict[str, Any], ctx: WorkerContext) -> dict[str, Any]:
    """Shapes, dtypes, statics and output specs of a task, at its own scale and at validation scale."""
    ctx.guard()
    ctx.stage("load")
    try:
        ref = taskcode.Reference(payload["source"])
        ctx.stage("trace")
        own = taskcode.abstract_inputs(ref, "tpu" if ref.accepts_scale else None)
        tolerances = payload["tolerances"]
        own_configs = [_config(ref, d, s, tolerances, i) for i, (d, s) in enumerate(own)]
        scale = payload.get("scale") or "auto"
        mode, factor, note = _validation_mode(scale, ref)
        if mode == "cpu":
            val = taskcode.abstract_inputs(ref, "cpu")
            val_configs = [_config(ref, d, s, tolerances, i) for i, (d, s) in enumerate(val)]
        elif mode == "shrink":
            keep = taskcode.keep_multiple_for(ref.format, factor)
            mapping = taskcode.shrink_map(own, factor, keep)
            if keep > taskcode.TILE_MULTIPLE:
                note += f"; power-of-two multiples up to {keep} kept"
            val_configs = []
            for i, (d, s) in enumerate(own):
                d2, s2 = taskcode.shrink_config(d, s, mapping)
                val_configs.append(_config(ref, d2, s2, tolerances, i))
        else:
            val_configs = own_configs
        return {
            "ok": True,
            "configs": [c.model_dump(mode="json") for c in own_configs],
            "validation_configs": [c.model_dump(mode="json") for c in val_configs],
            "validation_mode": mode,
            "validation_factor": factor,
            "validation_note": note,
        }
    except taskcode.TaskCodeError as exc:
        return {"ok": False, "error": str(exc)}


def _validation_mode(scale: str, ref: taskcode.Reference) -> tuple[str, float, str]:
    if scale == "tpu":
        return "task", 1.0, "the task's own shapes"
    if scale in ("cpu", "auto"):
        if ref.accepts_scale:
            return "cpu", 1.0, "the task's CPU-scale shapes (get_inputs(scale='cpu'))"
        if scale == "cpu":
            return "shrink", 0.25, "the task's shapes shrunk x0.25 (tile multiples kept)"
        return "task", 1.0, "the task's own shapes"
    try:
        factor = float(scale)
    except ValueError as exc:
        raise taskcode.TaskCodeError(
            f"--scale must be cpu, tpu, auto or a factor in (0, 1]; got {scale!r}"
        ) from exc
    if not 0 < factor <= 1:
        raise taskcode.TaskCodeError(f"--scale factor must be in (0, 1]; got {factor}")
    if factor == 1:
        return "task", 1.0, "the task's own shapes"
    return "shrink", factor, f"the task's shapes shrunk x{factor:g} (tile multiples kept)"


def _config(
    ref: taskcode.Reference, dyn: list[ArraySpec], static: list[Any], tolerances: dict[str, Any], index: int
) -> InputConfig:
    outs = taskcode.output_specs(ref, dyn, static)
    atol, rtol = _tolerance(tolerances, index, outs)
    return InputConfig(dynamic=dyn, static=static, outputs=outs, atol=atol, rtol=rtol)


def _tolerance(tolerances: dict[str, Any], index: int, outs: list[ArraySpec]) -> tuple[float, float]:
    def pick(value: Any) -> float | None:
        if value is None:
            return None
        if isinstance(value, list | tuple):
            return float(value[min(index, len(value) - 1)])
        return float(value)

    low_precision = any(o.dtype in ("bfloat16", "float16") or o.dtype.startswith("float8") for o in outs)
    default = 2e-2 if low_precision else 1e-3
    atol = pick(tolerances.get("atol"))
    rtol = pick(tolerances.get("rtol"))
    return (default if atol is None else atol), (default if rtol is None else rtol)


# --- evaluate ---------------------------------------------------------------------------------------------


class _Rejected(Exception):
    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.message = message


def evaluate_job(payload: dict[str, Any], ctx: WorkerContext) -> dict[str, Any]:
    """Run every stage on one candidate; return an `EvalResult` as JSON."""
    task = payload["task"]
    opts = payload["options"]
    result = EvalResult(task_id=task["task_id"], source_hash=payload["source_hash"])
    clock = _StageClock(ctx, result)
    ctx.guard()
    extras: dict[str, Any] = {}
    try:
        _evaluate(task, extras, payload["candidate_path"], opts, result, clock)
    except _Rejected as exc:
        result.error = StageError(stage=exc.stage, message=exc.message)  # type: ignore[arg-type]
    clock.stop()
    if ctx.violations:
        result.error = StageError(stage="sandbox", message="sandbox violation: " + "; ".join(ctx.violations))
    result.accepted = result.error is None and result.correct and result.uses_pallas and result.compiled
    if result.accepted is False and result.error is None:
        result.error = StageError(stage="compile", message="not compiled for every requested TPU generation")
    return {**result.model_dump(mode="json"), **extras}


class _StageClock:
    def __init__(self, ctx: WorkerContext, result: EvalResult) -> None:
        self.ctx, self.result = ctx, result
        self.name: str | None = None
        self.t0 = 0.0

    def start(self, name: str) -> None:
        self.stop()
        self.ctx.stage(name)
        self.name, self.t0 = name, time.perf_counter()

    def stop(self) -> None:
        if self.name:
            self.result.stage_seconds[self.name] = round(time.perf_counter() - self.t0, 4)
            self.name = None


def save_reference_sets(
    path: Path, input_sets: list[list[tuple[list[np.ndarray], str]]], expected: list[list[list[np.ndarray]]]
) -> None:
    """Inputs and reference outputs of every set, with dtype names (npz cannot name bfloat16)."""
    arrays: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {"configs": []}
    for ci, sets in enumerate(input_sets):
        cmeta = []
        for si, (inputs, origin) in enumerate(sets):
            entry = {"origin": origin, "inputs": [], "outputs": []}
            for k, a in enumerate(inputs):
                arrays[f"c{ci}s{si}i{k}"] = _raw(a)
                entry["inputs"].append(str(a.dtype))
            for k, a in enumerate(expected[ci][si]):
                arrays[f"c{ci}s{si}o{k}"] = _raw(a)
                entry["outputs"].append(str(a.dtype))
            cmeta.append(entry)
        meta["configs"].append(cmeta)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def load_reference_sets(
    path: Path,
) -> tuple[list[list[tuple[list[np.ndarray], str]]], list[list[list[np.ndarray]]]]:
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        input_sets, expected = [], []
        for ci, cmeta in enumerate(meta["configs"]):
            sets, outs = [], []
            for si, entry in enumerate(cmeta):
                ins = [_typed(z[f"c{ci}s{si}i{k}"], d) for k, d in enumerate(entry["inputs"])]
                sets.append((ins, entry["origin"]))
                outs.append([_typed(z[f"c{ci}s{si}o{k}"], d) for k, d in enumerate(entry["outputs"])])
            input_sets.append(sets)
            expected.append(outs)
    return input_sets, expected


def _raw(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype.name == "bfloat16" else a


def _typed(a: np.ndarray, dtype: str) -> np.ndarray:
    return a.view(np_dtype(dtype)) if dtype == "bfloat16" else a


def _evaluate(
    task: dict[str, Any],
    result_extras: dict[str, Any],
    candidate_path: str,
    opts: dict[str, Any],
    result: EvalResult,
    clock: _StageClock,
) -> None:
    import jax
    from jax.experimental.pallas import tpu as pltpu

    clock.start("reference")
    try:
        ref = taskcode.Reference(
            {
                "format": task["format"],
                "reference_path": task["reference_path"],
                "input_gen_code": task.get("input_gen_code"),
            }
        )
        own = [InputConfig.model_validate(c) for c in task["configs"]]
        val = [InputConfig.model_validate(c) for c in task["validation_configs"]]
        cached = opts.get("reference_cache")
        if cached:
            input_sets, expected = load_reference_sets(Path(cached))
        else:
            input_sets = _build_input_sets(
                ref, task, val, int(opts.get("input_sets", 3)), int(opts.get("seed", 0))
            )
            expected = [
                [_run_reference(ref, cfg, inputs) for inputs, _origin in sets]
                for cfg, sets in zip(val, input_sets, strict=True)
            ]
            # Written and hashed before the candidate is imported; the hash travels in the signed result,
            # so the parent caches this file only if the candidate did not touch it.
            path = Path(clock.ctx.run_dir) / "reference_sets.npz"
            save_reference_sets(path, input_sets, expected)
            result_extras["_reference_sets_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    except taskcode.TaskCodeError as exc:
        raise _Rejected("task", str(exc)) from exc

    clock.start("load")
    try:
        module = taskcode.load_module(Path(candidate_path), "maxkernel_candidate")
    except SyntaxError as exc:
        raise _Rejected("load", f"syntax error line {exc.lineno}: {exc.msg}") from exc
    except Exception as exc:
        raise _Rejected("load", f"{type(exc).__name__}: {exc}") from exc
    candidate = taskcode.candidate_entry(module)
    if candidate is None:
        names = " or ".join(f"`{n}`" for n in taskcode.CANDIDATE_ENTRY_POINTS)
        raise _Rejected("load", f"the candidate module has no function {names}")

    interpret = pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise")
    correctness = CorrectnessResult(ok=True, scale=task.get("validation_note", ""))
    result.correctness = correctness
    compiled_fns = []
    for ci, cfg in enumerate(val):
        correctness.shapes_used.append(cfg.describe())
        clock.start("trace")
        fn = _bind_static(candidate, cfg.static)
        example = [jax.numpy.asarray(a) for a in input_sets[ci][0][0]]
        try:
            with pltpu.force_tpu_interpret_mode(interpret):
                traced = jax.jit(fn).trace(*example)
                out_tree = jax.tree_util.tree_leaves(traced.out_info)
                _check_outputs(out_tree, cfg.outputs)
                check, warnings = check_pallas_does_work(traced.jaxpr)
                compiled = traced.lower().compile()
        except _Rejected:
            raise
        except Exception as exc:
            _reset_interpret()
            raise _Rejected("trace", f"{type(exc).__name__}: {_first_lines(str(exc))}") from exc
        clock.start("pallas")
        result.pallas = check
        for w in warnings:
            if w not in result.warnings:
                result.warnings.append(w)
        if not check.ok:
            raise _Rejected("pallas", check.reason or "Pallas does not do the work")
        result.uses_pallas = True
        compiled_fns.append(compiled)

    # Compile before checking values: a kernel Mosaic rejects is reported as a compile failure (what the
    # repair loop needs to hear first), yet its correctness is still measured and recorded.
    gens = list(opts.get("tpu", []))
    clock.start("compile")
    for gen in gens:
        result.tpu_compile[gen] = _aot_compile(candidate, own, gen)
    result.compiled = all(o.ok for o in result.tpu_compile.values())
    if not gens:
        result.warnings.append("no TPU generation requested: compiled means lowered for interpret mode only")
    failed = [g for g, o in result.tpu_compile.items() if not o.ok]

    clock.start("correctness")
    run_error: str | None = None
    for ci, cfg in enumerate(val):
        for si, (inputs, origin) in enumerate(input_sets[ci]):
            try:
                with pltpu.force_tpu_interpret_mode(interpret):
                    out = compiled_fns[ci](*[jax.numpy.asarray(a) for a in inputs])
                    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(out)]
            except Exception as exc:
                _reset_interpret()
                run_error = f"running input set {si}: {type(exc).__name__}: {_first_lines(str(exc))}"
                correctness.sets.append(
                    SetCheck(config=ci, input_set=si, origin=origin, ok=False, message=run_error)  # type: ignore[arg-type]
                )
                break
            correctness.sets.append(_compare(leaves, expected[ci][si], cfg, ci, si, origin))
        if run_error:
            break
    _summarise(correctness)
    result.max_abs_err, result.max_rel_err = correctness.max_abs_err, correctness.max_rel_err
    result.correct = correctness.ok

    if failed:
        first = result.tpu_compile[failed[0]].error or ""
        raise _Rejected("compile", f"Mosaic compile failed for {', '.join(failed)}: {_first_lines(first, 6)}")
    if not correctness.ok:
        bad = next(s for s in correctness.sets if not s.ok)
        raise _Rejected(
            "correctness", f"config {bad.config} input set {bad.input_set} ({bad.origin}): {bad.message}"
        )

    if opts.get("estimate", True):
        clock.start("estimate")
        gen = gens[0] if gens else "v5e"
        result.estimate = _estimate(ref, candidate, own, gen, opts.get("reference_estimated_seconds"))

    if opts.get("timing", True):
        clock.start("timing")
        result.timing = _measure(ref, candidate, val, input_sets, expected, opts)
        if result.timing is None:
            result.warnings.append("timing: no TPU/GPU here, nothing was measured")
        elif not result.timing.rechecked_correct:
            raise _Rejected("timing", "outputs after the timed runs no longer match the reference")


def _bind_static(fn: Any, static: list[Any]) -> Any:
    def bound(*dynamic: Any) -> Any:
        return fn(*dynamic, *static)

    return bound


def _check_outputs(leaves: list[Any], expected: list[ArraySpec]) -> None:
    got = [taskcode.spec_of(x) for x in leaves]
    if len(got) != len(expected) or any(g != e for g, e in zip(got, expected, strict=False)):
        raise _Rejected(
            "trace",
            "output shapes/dtypes differ from the reference: got "
            + ", ".join(map(str, got))
            + "; expected "
            + ", ".join(map(str, expected)),
        )


def _first_lines(text: str, n: int = 12) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return "\n".join(lines[:n]) + ("\n..." if len(lines) > n else "")


def _reset_interpret() -> None:
    try:
        from jax.experimental.pallas import tpu as pltpu

        pltpu.reset_tpu_interpret_mode_state()
    except Exception:  # noqa: BLE001 - best effort clean-up after a failed interpreted run
        pass


def _build_input_sets(
    ref: taskcode.Reference, task: dict[str, Any], val: list[InputConfig], n_sets: int, seed: int
) -> list[list[tuple[list[np.ndarray], str]]]:
    """Per validation config: the task's own inputs (when they exist at these shapes), then fresh draws."""
    import jax

    mode = task["validation_mode"]
    hold = set(task.get("hold_inputs") or [])
    n_sets = max(n_sets, 1)
    out: list[list[tuple[list[np.ndarray], str]]] = []
    if mode in ("task", "cpu"):
        raw = ref.raw_inputs("cpu" if mode == "cpu" else ("tpu" if ref.accepts_scale else None))
        for ci, (dyn, _static) in enumerate(raw):
            own = [taskcode.to_numpy(a) for a in dyn]
            sets = [(own, "task")]
            for s in range(1, n_sets):
                rng = np.random.default_rng([seed, ci, s])
                sets.append(([taskcode.random_like(a, rng, i in hold) for i, a in enumerate(own)], "random"))
            out.append(sets)
        return out

    # shrink: the task's values exist only at full size; draw every set from their statistics, computed
    # under jit so the full-size inputs need not be materialised at once.
    def stats() -> list[list[dict[str, Any]]]:
        res = []
        for dyn, _ in ref.raw_inputs(None):
            res.append(
                [
                    {
                        "min": jax.numpy.min(a.astype("float32")),
                        "max": jax.numpy.max(a.astype("float32")),
                        "mean": jax.numpy.mean(a.astype("float32")),
                        "std": jax.numpy.std(a.astype("float32")),
                    }
                    for a in dyn
                ]
            )
        return res

    observed = jax.device_get(jax.jit(stats)())
    for ci, cfg in enumerate(val):
        sets = []
        for s in range(n_sets):
            rng = np.random.default_rng([seed, ci, s, 7])
            st = [{k: float(v) for k, v in d.items()} for d in observed[ci]]
            sets.append(
                (
                    [taskcode.random_from_spec(spec, rng, st[i]) for i, spec in enumerate(cfg.dynamic)],
                    "random",
                )
            )
        out.append(sets)
    return out


def _run_reference(ref: taskcode.Reference, cfg: InputConfig, inputs: list[np.ndarray]) -> list[np.ndarray]:
    import jax

    try:
        out = jax.jit(_bind_static(ref.computation, cfg.static))(*[jax.numpy.asarray(a) for a in inputs])
        return [np.asarray(x) for x in jax.tree_util.tree_leaves(out)]
    except Exception as exc:
        raise taskcode.TaskCodeError(
            f"the reference failed on shapes {cfg.describe()}: {type(exc).__name__}: {_first_lines(str(exc), 4)}"
        ) from exc


def _compare(
    got: list[np.ndarray], want: list[np.ndarray], cfg: InputConfig, ci: int, si: int, origin: str
) -> SetCheck:
    check = SetCheck(config=ci, input_set=si, origin=origin, ok=True, max_abs_err=0.0, max_rel_err=0.0)  # type: ignore[arg-type]
    for leaf, (g, w) in enumerate(zip(got, want, strict=True)):
        g64 = g.astype(np.float64) if g.dtype != bool else g.astype(np.float64)
        w64 = w.astype(np.float64) if w.dtype != bool else w.astype(np.float64)
        both_nan = np.isnan(g64) & np.isnan(w64)
        nan_out = int(np.sum(np.isnan(g64) & ~np.isnan(w64)))
        same_inf = np.isinf(g64) & (g64 == w64)
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.where(both_nan | same_inf, 0.0, np.abs(g64 - w64))
            bad = ~(diff <= cfg.atol + cfg.rtol * np.abs(np.where(np.isfinite(w64), w64, 0.0)))
        mism = int(np.sum(bad))
        finite = np.isfinite(diff)
        max_abs = float(diff[finite].max()) if finite.any() else math.inf
        big = finite & (np.abs(w64) > cfg.atol)
        max_rel = float((diff[big] / np.abs(w64[big])).max()) if big.any() else 0.0
        check.max_abs_err = max(check.max_abs_err or 0.0, max_abs if mism or nan_out == 0 else math.inf)
        check.max_rel_err = max(check.max_rel_err or 0.0, max_rel)
        check.mismatches += mism
        check.nan_outputs += nan_out
        if mism and check.ok:
            check.ok = False
            idx = np.unravel_index(
                int(np.argmax(np.where(bad, diff if finite.all() else 1.0, -1.0))), bad.shape
            )
            check.message = (
                f"output {leaf}: {mism} of {bad.size} elements outside atol={cfg.atol:g}, rtol={cfg.rtol:g}"
                + (
                    f" ({nan_out} NaN where the reference is finite: unwritten or poisoned memory)"
                    if nan_out
                    else ""
                )
                + f"; e.g. at {tuple(int(i) for i in idx)}: got {float(g64[idx]):.6g}, expected {float(w64[idx]):.6g}"
            )
    return check


def _summarise(c: CorrectnessResult) -> None:
    c.ok = all(s.ok for s in c.sets) and len(c.sets) > 0
    errs = [s.max_abs_err for s in c.sets if s.max_abs_err is not None]
    rels = [s.max_rel_err for s in c.sets if s.max_rel_err is not None]
    c.max_abs_err = max(errs) if errs else None
    c.max_rel_err = max(rels) if rels else None


def _aot_compile(candidate: Any, configs: list[InputConfig], gen: str) -> CompileOutcome:
    """Compile with the real Mosaic compiler for `gen` at the task's own shapes; no data is allocated."""
    import jax
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    t0 = time.perf_counter()
    from maxkernel.tools.tpu_specs import get_spec

    try:
        topology = get_spec(gen).topology
    except ValueError as exc:
        return CompileOutcome(ok=False, error=str(exc))
    try:
        device = topologies.get_topology_desc(topology, "tpu").devices[0]
    except Exception as exc:
        return CompileOutcome(
            ok=False, error=f"no TPU compiler available (libtpu): {type(exc).__name__}: {exc}"
        )
    sharding = SingleDeviceSharding(device)
    for cfg in configs:
        specs = [jax.ShapeDtypeStruct(a.shape, np_dtype(a.dtype), sharding=sharding) for a in cfg.dynamic]
        try:
            jax.jit(_bind_static(candidate, cfg.static)).trace(*specs).lower().compile()
        except Exception as exc:
            return CompileOutcome(
                ok=False, error=f"{type(exc).__name__}: {exc}", seconds=round(time.perf_counter() - t0, 3)
            )
    return CompileOutcome(ok=True, seconds=round(time.perf_counter() - t0, 3))


def _estimate(
    ref: taskcode.Reference, candidate: Any, own: list[InputConfig], gen: str, cached_reference: float | None
) -> EstimateSummary:
    """TPU time estimates at the task's own shapes: the candidate's pallas_calls through the block model,
    the reference through the TPU compiler's cost model (cached by the caller per task and generation).
    Estimates only: nothing here ran on a TPU."""
    import jax

    from maxkernel.tools.estimate import estimate_pallas, estimate_xla

    cfg = own[0]
    specs = [jax.ShapeDtypeStruct(a.shape, np_dtype(a.dtype)) for a in cfg.dynamic]
    summary = EstimateSummary(generation=gen, method="")
    notes = []
    try:
        cand = estimate_pallas(jax.make_jaxpr(_bind_static(candidate, cfg.static))(*specs), gen)
        summary.estimated_seconds = cand.estimated_seconds
        summary.bound = cand.bound
        summary.method = cand.method
        summary.detail_markdown = cand.to_markdown()
    except Exception as exc:  # noqa: BLE001 - an estimate failing must not fail an accepted kernel
        notes.append(f"block model failed: {type(exc).__name__}: {exc}")
    reference_s = cached_reference
    if reference_s is None:
        try:
            reference_s = estimate_xla(
                _bind_static(ref.computation, cfg.static), specs, gen
            ).estimated_seconds
        except Exception as exc:  # noqa: BLE001
            notes.append(f"reference cost model failed: {type(exc).__name__}: {exc}")
    summary.reference_estimated_seconds = reference_s
    summary.method += "; reference: TPU compiler cost model (optimal_seconds)"
    if summary.estimated_seconds and summary.estimated_seconds > 0 and reference_s and reference_s > 0:
        summary.estimated_speedup = reference_s / summary.estimated_seconds
    elif reference_s is not None and reference_s <= 0:
        notes.append(f"the compiler's estimate for the reference is not a time ({reference_s:g} s): no speedup")
    summary.note = "; ".join(notes) or None
    return summary


def _measure(
    ref: taskcode.Reference,
    candidate: Any,
    val: list[InputConfig],
    input_sets: list[list[tuple[list[np.ndarray], str]]],
    expected: list[list[list[np.ndarray]]],
    opts: dict[str, Any],
) -> MeasuredTiming | None:
    """Median wall time of the candidate and the reference on a real accelerator; None on CPU."""
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu":
        return None
    warmups, runs = int(opts.get("warmups", 3)), max(int(opts.get("runs", 20)), 20)
    cfg, (inputs, _) = val[0], input_sets[0][0]
    args = [jax.device_put(a, device) for a in inputs]
    cand = jax.jit(_bind_static(candidate, cfg.static))
    refn = jax.jit(_bind_static(ref.computation, cfg.static))

    def timed(fn: Any) -> tuple[list[float], Any]:
        out = None
        for _ in range(warmups):
            out = jax.block_until_ready(fn(*args))
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
        return times, out

    ct, cout = timed(cand)
    rt, _ = timed(refn)
    recheck = _compare(
        [np.asarray(x) for x in jax.tree_util.tree_leaves(cout)], expected[0][0], cfg, 0, 0, "task"
    )
    cq = np.percentile(ct, [25, 50, 75])
    rq = np.percentile(rt, [25, 50, 75])
    return MeasuredTiming(
        device=str(device.device_kind),
        warmups=warmups,
        runs=runs,
        candidate_median_s=float(cq[1]),
        candidate_spread_s=float(cq[2] - cq[0]),
        reference_median_s=float(rq[1]),
        reference_spread_s=float(rq[2] - rq[0]),
        measured_speedup=float(rq[1] / cq[1]),
        rechecked_correct=recheck.ok,
    )
