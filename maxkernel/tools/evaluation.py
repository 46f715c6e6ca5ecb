"""Task-side jobs and the pieces of judging shared by the judge child and the agent.

`describe_job` learns a task's shapes in a sandboxed child (task code never runs in the agent).
`build_input_sets` / `run_reference` are what the judge child (`judge`) runs; `compare` / `summarise`
are pure numpy and run in the agent, on outputs read back from the candidate's process. Nothing in this
module ever imports a candidate: that happens only in `candidate`.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from maxkernel.tools import taskcode
from maxkernel.tools.results import (
    ArraySpec,
    CorrectnessResult,
    EstimateSummary,
    InputConfig,
    SetCheck,
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
        for cfg, values in zip(
            own_configs, taskcode.small_int_inputs(ref, "tpu" if ref.accepts_scale else None), strict=False
        ):
            cfg.index_values = values
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
        budget = payload.get("memory_budget")
        need = 4 * sum(c.input_bytes() + c.output_bytes() for c in val_configs)
        reference_s = _time_reference(ref, val_configs) if budget is None or need <= budget else 0.0
        if ctx.violations:
            return {"ok": False, "error": "the task's code did something the sandbox forbids when loaded or "
                    "run: " + "; ".join(ctx.violations)}  # fmt: skip
        return {
            "ok": True,
            "reference_seconds": reference_s,
            "configs": [c.model_dump(mode="json") for c in own_configs],
            "validation_configs": [c.model_dump(mode="json") for c in val_configs],
            "validation_mode": mode,
            "validation_factor": factor,
            "validation_note": note,
        }
    except taskcode.TaskCodeError as exc:
        if ctx.violations:
            return {"ok": False, "error": "the task's code did something the sandbox forbids: "
                    + "; ".join(ctx.violations)}  # fmt: skip
        return {"ok": False, "error": str(exc)}


def _time_reference(ref: taskcode.Reference, configs: list[InputConfig]) -> float:
    """Seconds for one jitted reference run (compile included) per validation config, on zeros: what the
    default evaluation timeout is derived from (see `harness.default_timeout`)."""
    import jax

    t0 = time.perf_counter()
    for cfg in configs:
        args = [np.zeros(a.shape, np_dtype(a.dtype)) for a in cfg.dynamic]
        try:
            jax.block_until_ready(jax.jit(bind_static(ref.computation, cfg.static))(*args))
        except Exception as exc:
            raise taskcode.TaskCodeError(
                f"the reference failed on shapes {cfg.describe()}: {type(exc).__name__}: {_first_lines(str(exc), 4)}"
            ) from exc
    return round(time.perf_counter() - t0, 4)


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


def bind_static(fn: Any, static: list[Any]) -> Any:
    """`fn` with the config's static arguments appended: what tracing and estimating take (public: the
    candidate job and the profiler's worker job bind the same way)."""

    def bound(*dynamic: Any) -> Any:
        return fn(*dynamic, *static)

    return bound


def _first_lines(text: str, n: int = 12) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return "\n".join(lines[:n]) + ("\n..." if len(lines) > n else "")


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
    if mode in ("task", "cpu"):
        if own_inputs is None:
            raw = ref.raw_inputs("cpu" if mode == "cpu" else ("tpu" if ref.accepts_scale else None))
            own_inputs = [[taskcode.to_numpy(a) for a in dyn] for dyn, _static in raw]
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
            f"the reference failed on shapes {cfg.describe()}: {type(exc).__name__}: {_first_lines(str(exc), 4)}"
        ) from exc


def reference_fn(ref: taskcode.Reference, cfg: InputConfig) -> Any:
    import jax

    return jax.jit(bind_static(ref.computation, cfg.static))


def compare(
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
