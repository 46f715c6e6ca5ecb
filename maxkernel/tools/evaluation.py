"""Task-side jobs and the pieces of judging shared by the judge child and the agent.

`describe_job` learns a task's shapes in a sandboxed child (task code never runs in the agent).
`build_input_sets` / `run_reference` are what the judge child (`judge`) runs; `compare` / `summarise`
are pure numpy and run in the agent, on outputs read back from the candidate's process. Nothing in this
module ever imports a candidate: that happens only in `candidate`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from maxkernel.tools import taskcode
from maxkernel.tools import validation_sizing as sizing
from maxkernel.tools.results import (
    ArraySpec,
    CorrectnessResult,
    EstimateSummary,
    InputConfig,
    SetCheck,
    first_lines,
    low_precision_float,
    np_dtype,
)
from maxkernel.tools.worker import WorkerContext

# --- describe ---------------------------------------------------------------------------------------------


def describe_job(payload: dict[str, Any], ctx: WorkerContext) -> dict[str, Any]:
    """Shapes, dtypes, statics and output specs of a task, at its own scale and at validation scale."""
    ctx.guard()
    ctx.stage("load")
    try:
        ref = taskcode.reference_for(payload["source"], None)
        ctx.stage("trace")
        own = taskcode.abstract_inputs(ref, "tpu" if ref.accepts_scale else None)
        tolerances = payload["tolerances"]
        own_configs = [_config(ref, d, s, tolerances, i) for i, (d, s) in enumerate(own)]
        for cfg, values in zip(
            own_configs, taskcode.small_int_inputs(ref, "tpu" if ref.accepts_scale else None), strict=False
        ):
            cfg.index_values = values
        scale = payload.get("scale") or "auto"
        sized = _size_validation(ref, own, scale, payload, lambda: ctx.stage("reference"))
        val_configs = [
            _config(taskcode.reference_for(ref.source, sized.knobs), d, s, tolerances, i, sized.knobs)
            for i, (d, s) in enumerate(sized.configs)
        ]
        larger = None
        if sized.larger is not None:
            larger_ref = taskcode.reference_for(ref.source, sized.larger.values)
            d, s = sized.larger.configs[0]
            larger = _config(larger_ref, d, s, tolerances, 0, sized.larger.values)
        ctx.stage("reference")  # a crash from here on is the size's: `tasks.load_task` asks again smaller
        reference_s = sized.reference_seconds
        if reference_s is None:  # sized without running (an explicit scale): run it once here
            budget = payload.get("memory_budget")
            need = 4 * sum(c.input_bytes() + c.output_bytes() for c in val_configs)
            reference_s = _time_reference(ref, val_configs) if budget is None or need <= budget else 0.0
        if ctx.violations:
            return {"ok": False, "error": "the task's code did something the sandbox forbids when loaded or "
                    "run: " + "; ".join(ctx.violations)}  # fmt: skip
        return {
            "ok": True,
            "reference_seconds": reference_s,
            "predicted_set_seconds": sized.predicted_set_seconds,
            "configs": [c.model_dump(mode="json") for c in own_configs],
            "validation_configs": [c.model_dump(mode="json") for c in val_configs],
            "larger_config": larger.model_dump(mode="json") if larger is not None else None,
            "validation_mode": sized.mode,
            "validation_factor": sized.factor,
            "validation_note": sized.note,
        }
    except taskcode.TaskCodeError as exc:
        if ctx.violations:
            return {"ok": False, "error": "the task's code did something the sandbox forbids: "
                    + "; ".join(ctx.violations)}  # fmt: skip
        return {"ok": False, "error": str(exc)}


@dataclass
class _Sized:
    """The validation sizes `describe_job` settled on."""

    mode: str
    configs: list[tuple[list[ArraySpec], list[Any]]]
    note: str
    factor: float = 1.0
    knobs: dict[str, int] = field(default_factory=dict)
    larger: sizing.Probe | None = None
    predicted_set_seconds: float = 0.0
    cost: sizing.Cost = field(default_factory=sizing.Cost)
    reference_seconds: float | None = None
    """Measured while sizing (the reference ran there), else None."""


REFERENCE_RETRIES = 3
"""How many times a reference that fails at the planned validation size (out of memory, an XLA:CPU error)
is planned again at a quarter of the budget before the task is refused."""


def _size_validation(
    ref: taskcode.Reference,
    own: list[tuple[list[ArraySpec], list[Any]]],
    scale: str,
    payload: dict[str, Any],
    running: Callable[[], None] = lambda: None,
) -> _Sized:
    """Pick the validation sizes (see `validation_sizing`): an explicit `--scale` as asked; the task's own
    CPU scale where it has one; else the budget search, run and measured, and shrunk further when the
    reference fails there."""
    mode, factor, note = _validation_mode(scale, ref)
    if mode == "cpu":
        return _Sized("cpu", taskcode.abstract_inputs(ref, "cpu"), note)
    if mode == "task":
        return _Sized("task", own, note)
    if mode == "shrink":
        keep = taskcode.keep_multiple_for(ref.format, factor)
        if keep > taskcode.TILE_MULTIPLE:
            note += f"; power-of-two multiples up to {keep} kept"
        return _Sized("shrink", _shrunk(own, factor, keep), note, factor=factor)
    rates = sizing.Rates(**payload["rates"]) if payload.get("rates") else sizing.DEFAULT_RATES
    budget = sizing.Budget(
        seconds_per_set=float(payload.get("seconds_per_set") or sizing.Budget.seconds_per_set),
        memory_bytes=int(payload.get("memory_budget") or sizing.Budget.memory_bytes),
        tiles_first=bool(payload.get("tiles_first")),
    )
    failures: list[str] = []
    tried: list[tuple[list[ArraySpec], list[Any]]] | None = None
    failed_at: int | None = None
    for _attempt in range(REFERENCE_RETRIES + 1):
        sized = _plan(ref, own, budget, rates)
        if failures:
            sized.note += "; smaller than planned: at the larger size " + failures[-1]
        if failures and sized.configs == tried:
            break  # a smaller budget found nothing smaller
        tried = sized.configs
        running()
        error = _run_planned(ref, sized)
        if error is None:
            if (
                failed_at is not None
                and sized.larger is not None
                and sized.larger.cost.peak_bytes >= failed_at
            ):
                sized.larger = None  # no larger check where the reference already failed
            return sized
        failed_at = min(failed_at or sized.cost.peak_bytes, sized.cost.peak_bytes)
        failures.append(error)
        # Strictly smaller than what failed: a quarter of its predicted time and memory.
        budget = sizing.Budget(
            seconds_per_set=min(budget.seconds_per_set, sized.cost.candidate_seconds(rates)) / 4,
            memory_bytes=min(budget.memory_bytes, max(sized.cost.peak_bytes, 4 * sized.cost.io_bytes)) // 4,
            tiles_first=budget.tiles_first,
        )
    raise taskcode.TaskCodeError(
        "the reference cannot run at any validation size this machine allows: " + "; then ".join(failures)
    )


def _plan(
    ref: taskcode.Reference,
    own: list[tuple[list[ArraySpec], list[Any]]],
    budget: sizing.Budget,
    rates: sizing.Rates,
) -> _Sized:
    def probe_of(values: dict[str, int]) -> sizing.Probe:
        r = taskcode.reference_for(ref.source, values) if values else ref
        configs = taskcode.abstract_inputs(r, None) if values else own
        cost, structure, dims = sizing.Cost(), (), ()
        for dyn, static in configs:
            c, st, dm = sizing.program_cost(r.computation, dyn, static)
            cost, structure, dims = cost + c, structure + st, dims + dm
        return sizing.Probe(
            dict(values),
            configs,
            cost,
            structure,
            dims,
            int_max_of=lambda: taskcode.integer_maxima(r, configs),
        )

    try:
        own_probe = probe_of({})
    except Exception as exc:  # noqa: BLE001 - the reference itself does not trace at its own shapes
        raise taskcode.TaskCodeError(
            f"the reference computation failed to trace: {type(exc).__name__}: {first_lines(str(exc), 4)}"
        ) from exc
    if budget.fits(own_probe.cost, rates):
        note = f"the task's own shapes ({own_probe.cost.describe(rates)}; within the budget)"
        return _Sized(
            "task",
            own,
            note,
            predicted_set_seconds=own_probe.cost.candidate_seconds(rates),
            cost=own_probe.cost,
        )
    knobs = taskcode.find_task_knobs(ref.source)
    keep = taskcode.SHRINK_KEEP_MULTIPLE.get(ref.format, taskcode.TILE_MULTIPLE)
    plan = sizing.plan_knobs(probe_of, knobs, own_probe, budget, rates, keep)
    if plan.probe.values:
        from maxkernel.tools.generator_knobs import describe as describe_knobs

        change = describe_knobs(knobs, plan.probe.values)
        return _Sized(
            "knobs",
            plan.probe.configs,
            sizing.describe_plan(plan, rates, budget, change),
            knobs=plan.probe.values,
            larger=plan.larger,
            predicted_set_seconds=plan.probe.cost.candidate_seconds(rates),
            cost=plan.probe.cost,
        )
    # No knob moves a shape: scale the arrays' dimensions, halving until the prediction fits.
    factor, configs, cost = 1.0, own, own_probe.cost
    while not budget.fits(cost, rates) and factor > 1 / 256:
        factor /= 2
        keep_f = taskcode.keep_multiple_for(ref.format, factor)
        configs = _shrunk(own, factor, keep_f)
        try:
            cost = sizing.Cost()
            for dyn, static in configs:
                cost = cost + sizing.program_cost(ref.computation, dyn, static)[0]
        except Exception:  # noqa: BLE001 - a dimension the reference derives broke: stop one step earlier
            factor *= 2
            configs = (
                _shrunk(own, factor, taskcode.keep_multiple_for(ref.format, factor)) if factor < 1 else own
            )
            break
    if factor >= 1:
        return _Sized(
            "task", own, f"the task's own shapes ({own_probe.cost.describe(rates)}; nothing to shrink)"
        )
    note = (
        f"the task's shapes shrunk x{factor:g} (no generator literal sets them; tile multiples kept; "
        f"{cost.describe(rates)})"
    )
    return _Sized("shrink", configs, note, factor=factor, predicted_set_seconds=cost.candidate_seconds(rates))


def _shrunk(
    own: list[tuple[list[ArraySpec], list[Any]]], factor: float, keep: int
) -> list[tuple[list[ArraySpec], list[Any]]]:
    mapping = taskcode.shrink_map(own, factor, keep)
    return [taskcode.shrink_config(d, s, mapping) for d, s in own]


def _run_planned(ref: taskcode.Reference, sized: _Sized) -> str | None:
    """Run the reference once at the planned sizes (the task's own inputs there, or zeros for scaled
    arrays); record the time; the error, if it fails (out of memory, an XLA:CPU failure), else None."""
    import jax

    r = taskcode.reference_for(ref.source, sized.knobs) if sized.knobs else ref
    t0 = time.perf_counter()
    try:
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            if sized.mode in taskcode.OWN_INPUT_MODES:
                arrays = [dyn for dyn, _ in r.raw_inputs(None)]
            else:
                arrays = [[np.zeros(a.shape, np_dtype(a.dtype)) for a in dyn] for dyn, _ in sized.configs]
            for args, (_dyn, static) in zip(arrays, sized.configs, strict=True):
                fn = bind_static(r.computation, static)
                jax.block_until_ready((fn if r.skip_jit else jax.jit(fn))(*args))
            del arrays
    except Exception as exc:  # noqa: BLE001 - OOM, XLA:CPU errors: the size, not the task, is at fault
        return f"{_describe_configs(sized.configs)}: {sizing.error_gist(exc)}"
    sized.reference_seconds = round(time.perf_counter() - t0, 4)
    return None


def _describe_configs(configs: list[tuple[list[ArraySpec], list[Any]]]) -> str:
    return "; ".join(", ".join(str(a) for a in dyn) for dyn, _ in configs)


def _time_reference(ref: taskcode.Reference, configs: list[InputConfig]) -> float:
    """Seconds for one jitted reference run (compile included) per validation config, on zeros: what the
    default evaluation timeout is derived from (see `harness.default_timeout`)."""
    import jax

    t0 = time.perf_counter()
    for cfg in configs:
        args = [np.zeros(a.shape, np_dtype(a.dtype)) for a in cfg.dynamic]
        r = taskcode.reference_for(ref.source, cfg.knobs) if cfg.knobs else ref
        fn = bind_static(r.computation, cfg.static)
        try:
            jax.block_until_ready((fn if r.skip_jit else jax.jit(fn))(*args))
        except Exception as exc:
            raise taskcode.TaskCodeError(
                f"the reference failed on shapes {cfg.describe()}: {type(exc).__name__}: {first_lines(str(exc), 4)}"
            ) from exc
    return round(time.perf_counter() - t0, 4)


def _validation_mode(scale: str, ref: taskcode.Reference) -> tuple[str, float, str]:
    """What `--scale` asks for: `tpu` the task's own shapes, a factor the arrays scaled, `cpu`/`auto` the
    task's CPU scale where its generator has one, else the budget search (mode `budget`)."""
    if scale == "tpu":
        return "task", 1.0, "the task's own shapes (--scale tpu)"
    if scale in ("cpu", "auto"):
        if ref.accepts_scale:
            return "cpu", 1.0, "the task's CPU-scale shapes (get_inputs(scale='cpu'))"
        return "budget", 1.0, ""
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
    ref: taskcode.Reference,
    dyn: list[ArraySpec],
    static: list[Any],
    tolerances: dict[str, Any],
    index: int,
    knobs: dict[str, int] | None = None,
) -> InputConfig:
    outs = taskcode.output_specs(ref, dyn, static)
    atol, rtol = _tolerance(tolerances, index, outs)
    return InputConfig(
        dynamic=dyn, static=static, outputs=outs, atol=atol, rtol=rtol, knobs=dict(knobs or {})
    )


def _tolerance(tolerances: dict[str, Any], index: int, outs: list[ArraySpec]) -> tuple[float, float]:
    def pick(value: Any) -> float | None:
        if value is None:
            return None
        if isinstance(value, list | tuple):
            return float(value[min(index, len(value) - 1)])
        return float(value)

    low_precision = any(low_precision_float(o.dtype) for o in outs)
    default = 2e-2 if low_precision else 1e-3
    atol = pick(tolerances.get("atol"))
    rtol = pick(tolerances.get("rtol"))
    return (default if atol is None else atol), (default if rtol is None else rtol)


def bind_static(fn: Any, static: list[Any]) -> Any:
    """`fn` with the config's static arguments appended: what tracing and estimating take (public: the
    candidate job and the profiler's worker job bind the same way)."""

    def bound(*dynamic: Any) -> Any:
        return fn(*dynamic, *static)

    return bound


def _reset_interpret() -> None:
    try:
        from jax.experimental.pallas import tpu as pltpu

        pltpu.reset_tpu_interpret_mode_state()
    except Exception:  # noqa: BLE001 - best effort clean-up after a failed interpreted run
        pass


def build_input_sets(
    ref: taskcode.Reference,
    task: dict[str, Any],
    val: list[InputConfig],
    n_sets: int,
    seed: int,
    own_inputs: list[list[np.ndarray]] | None = None,
) -> list[list[tuple[list[np.ndarray], str]]]:
    """Per validation config: the task's own inputs (when they exist at these shapes), then fresh draws.

    `seed` comes from the judge's per-run secret: a candidate cannot re-derive the draws. `own_inputs`:
    the task's own inputs from an earlier evaluation of the same task (`reference_cache`), which saves
    calling the task's `get_inputs`; they are not secret, the draws are."""
    import jax

    mode = task["validation_mode"]
    hold = set(task.get("hold_inputs") or [])
    n_sets = max(n_sets, 1)
    # Draw families: the sample's own statistics for the first fresh set, then wider ones (scaled, shifted,
    # special values), so a kernel that is right only inside the public sample's range is caught; always
    # within the task's declared input domain.
    out: list[list[tuple[list[np.ndarray], str]]] = []
    if mode in taskcode.OWN_INPUT_MODES:
        if own_inputs is None:
            own_inputs = taskcode.own_validation_inputs(ref.source, task)
        for ci, own in enumerate(own_inputs):
            sets = [(own, "task")]
            domains = taskcode.input_domains(task, len(own))
            for s in range(1, n_sets):
                rng = np.random.default_rng([seed, ci, s])
                draws = [taskcode.random_like(a, rng, i in hold, wide=s >= 2, domain=domains[i])
                         for i, a in enumerate(own)]  # fmt: skip
                sets.append((draws, "random"))
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
            domains = taskcode.input_domains(task, len(cfg.dynamic))
            draws = [taskcode.random_from_spec(spec, rng, st[i], wide=s >= 1 and i not in hold, domain=domains[i])
                     for i, spec in enumerate(cfg.dynamic)]  # fmt: skip
            sets.append((draws, "random"))
        out.append(sets)
    return out


def run_reference(
    ref: taskcode.Reference, cfg: InputConfig, inputs: list[np.ndarray], fn: Any = None
) -> list[np.ndarray]:
    """The reference's outputs for one input set. Pass `fn` (from `reference_fn`) to compile it once per
    configuration rather than once per set."""
    import jax

    try:
        fn = fn or reference_fn(ref, cfg)
        out = fn(*[jax.numpy.asarray(a) for a in inputs])
        return [np.asarray(x) for x in jax.tree_util.tree_leaves(out)]
    except Exception as exc:
        raise taskcode.TaskCodeError(
            f"the reference failed on shapes {cfg.describe()}: {type(exc).__name__}: {first_lines(str(exc), 4)}"
        ) from exc


def reference_fn(ref: taskcode.Reference, cfg: InputConfig, stepwise: bool = False) -> Any:
    """The reference for one configuration: the task's code with the config's generator knobs applied,
    jitted (as the task's own runner would, unless the module says `_skip_jit`). `stepwise`: compiled so
    that every op rounds to its own dtype as the program says (XLA otherwise may keep a fused chain's
    low-precision intermediates wider); None for a `_skip_jit` reference."""
    import jax

    r = taskcode.reference_for(ref.source, cfg.knobs) if cfg.knobs else ref
    fn = bind_static(r.computation, cfg.static)
    if stepwise:
        return None if r.skip_jit else jax.jit(fn, compiler_options={"xla_allow_excess_precision": False})
    return fn if r.skip_jit else jax.jit(fn)


def compare(
    got: list[np.ndarray],
    want: list[np.ndarray],
    cfg: InputConfig,
    ci: int,
    si: int,
    origin: str,
    precise: list[np.ndarray | None] | None = None,
    stepwise: list[np.ndarray | None] | None = None,
) -> SetCheck:
    """Each output element within atol + rtol * |expected| of the reference's. With `stepwise` (the judge's
    run of the reference rounding after every op, for low-precision float outputs where it differs), an
    element within the tolerance of that run is right too: both are faithful runs of the task's program.
    With `precise` (the judge's float32 run of the reference), an element that misses is still right when
    it is within the tolerance of that run plus the reference's own distance from it: the reference rounds
    too (a bf16 softmax's probabilities), and a kernel that rounds elsewhere is not wrong for it;
    `_rounding_allowance` says how far that goes (the reference's distance being the farther of its two
    runs)."""
    check = SetCheck(config=ci, input_set=si, origin=origin, ok=True, max_abs_err=0.0, max_rel_err=0.0)  # type: ignore[arg-type]
    for leaf, (g, w) in enumerate(zip(got, want, strict=True)):
        p = precise[leaf] if precise is not None and leaf < len(precise) else None
        r = stepwise[leaf] if stepwise is not None and leaf < len(stepwise) else None
        r = r.astype(np.float64) if r is not None and r.shape == g.shape else None
        g64 = g.astype(np.float64) if g.dtype != bool else g.astype(np.float64)
        w64 = w.astype(np.float64) if w.dtype != bool else w.astype(np.float64)
        both_nan = np.isnan(g64) & np.isnan(w64)
        nan_out = int(np.sum(np.isnan(g64) & ~np.isnan(w64)))
        same_inf = np.isinf(g64) & (g64 == w64)
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.where(both_nan | same_inf, 0.0, np.abs(g64 - w64))
            bad = ~(diff <= cfg.atol + cfg.rtol * np.abs(np.where(np.isfinite(w64), w64, 0.0)))
            if r is not None and bad.any():
                bad &= ~(np.abs(g64 - r) <= cfg.atol + cfg.rtol * np.abs(np.where(np.isfinite(r), r, 0.0)))
            rounding_note = ""
            if p is not None and bad.any() and p.shape == g64.shape:
                bad, rounding_note = _rounding_allowance(g64, w64, p.astype(np.float64), bad, cfg, r)
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
                + rounding_note
            )
    return check


# How much further from the float32 run than the reference itself a kernel may be, overall (root mean square
# over the output), for the elements the reference's rounding allowance accepts. XLA runs the reference
# fused and may skip roundings its program asks for; a kernel that rounds after every op as the program
# says is up to ~3x further (a bf16 matmul + swish + group norm: 0.0050 against XLA's 0.0017). Cutting
# precision is much further: bf16 accumulation over K terms grows with sqrt(K), an fp8 operand ~30x.
ROUNDING_RMS_FACTOR = 4.0


def _rounding_allowance(
    g: np.ndarray,
    w: np.ndarray,
    p: np.ndarray,
    bad: np.ndarray,
    cfg: InputConfig,
    r: np.ndarray | None = None,
) -> tuple[np.ndarray, str]:
    """Which of the `bad` elements of a low-precision output stay wrong once the reference's own rounding is
    allowed for, against its float32 run `p`. An element is right when it is within the tolerance of `p`
    plus the reference's distance from `p` at that element. Where it is not, rounding elsewhere is still
    the likeliest cause: a bf16 chain that rounds after each op turns one flipped last bit of an
    intermediate (a different accumulation order) into several units in the last place of an output near
    zero, and an epilogue kept in float32 rounds less than the reference. Such an element is right when it
    is within the tolerance of `p` plus the reference's WORST distance from `p` in this output, and the
    kernel as a whole is about as close to `p` as the reference is (root mean square, at most
    `ROUNDING_RMS_FACTOR` times). A kernel that is wrong on a few elements beyond rounding, or less precise
    throughout (a narrower accumulator), is still refused. With `r` (the reference rounding after every
    op), the reference's distance from `p` is the farther of its two runs'. Returns the mask and a note for
    the message."""
    finite = np.isfinite(g) & np.isfinite(p) & np.isfinite(w)
    own = np.where(finite, np.abs(w - p), 0.0)
    if r is not None:
        finite &= np.isfinite(r)
        own = np.where(finite, np.maximum(own, np.abs(r - p)), 0.0)
    dist = np.abs(g - p)
    tol = cfg.atol + cfg.rtol * np.abs(p)
    bad = bad & ~(finite & (dist <= tol + own))
    if not bad.any() or not finite.all():
        return bad, ""
    worst = float(own.max())
    rms_kernel = float(np.sqrt(np.mean(np.square(dist))))
    rms_ref = float(np.sqrt(np.mean(np.square(own))))
    within = dist <= tol + worst
    if rms_kernel <= ROUNDING_RMS_FACTOR * rms_ref and within[bad].all():
        return np.zeros_like(bad), ""
    why = (
        f"{int(np.sum(bad & ~within))} beyond the reference's worst rounding ({worst:.3g}) from its float32 run"
        if not within[bad].all()
        else f"its distance from the reference's float32 run (rms {rms_kernel:.3g}) is more than "
        f"{ROUNDING_RMS_FACTOR:g}x the reference's own (rms {rms_ref:.3g})"
    )
    return bad, f" (rounding allowance refused: {why})"


def summarise(c: CorrectnessResult) -> None:
    checked = c.sets + ([c.larger] if c.larger is not None else [])
    c.ok = all(s.ok for s in checked) and len(c.sets) > 0
    errs = [s.max_abs_err for s in checked if s.max_abs_err is not None]
    rels = [s.max_rel_err for s in checked if s.max_rel_err is not None]
    c.max_abs_err = max(errs) if errs else None
    c.max_rel_err = max(rels) if rels else None


def with_reference(summary: EstimateSummary, reference_s: float | None, notes: list[str]) -> EstimateSummary:
    """Complete a candidate's estimate (the harness's, from the candidate's process and audited) with the
    reference's (the compiler's cost model, computed by the judge) and the speedup."""
    from maxkernel.tools.estimate import estimated_speedup

    summary.reference_estimated_seconds = reference_s
    summary.method += (
        "; reference: TPU compiler cost model (optimal_seconds, with the corrections estimate_xla notes)"
    )
    if summary.estimated_seconds is not None and reference_s is not None:
        try:
            summary.estimated_speedup = estimated_speedup(reference_s, summary.estimated_seconds)
        except ValueError as exc:  # a non-positive estimate is not a time: no speedup, say why
            notes.append(f"no estimated speedup: {exc}")
    summary.note = "; ".join(notes) or None
    return summary
