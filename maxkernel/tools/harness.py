"""The evaluation harness, agent side: look the evaluation up, else run it and decide the verdict here.

One evaluation is three parties, and only one of them ever imports the candidate:

```
 agent (this module: decides, never runs task or candidate code)
   ├── judge child (trusted, sandboxed: runs the reference and the TPU compiler)   maxkernel.tools.judge
   │      secret input draws → inputs.npz, expected.npz → waits for TPU programs → inspect + compile
   └── candidate child (untrusted, sandboxed, nobody)                              maxkernel.tools.candidate
          load → trace (interpret / plain / production) → export for TPU → waits for inputs → outputs.npz
```

The order is what makes it hold: both children start at once; the agent reads the candidate's programs
(trees and the TPU export) as soon as the candidate announces it is waiting, *then* hands it the judge's
inputs, which were drawn from a secret the candidate's process never holds. The agent checks that Pallas
does the work on the trees (`checks`), that the interpret-mode, plain and production traces are the same
program (`program_tree.same_program`), forwards the exported TPU program to the judge, which checks the
StableHLO (`stablehlo_check`) and compiles that very program per generation, and compares the outputs
with the judge's expected outputs (numpy, here). Nothing the candidate can patch runs in a process that
decides, and every file read back from its run dir goes through `readback` (type, size, count, shape).

`evaluate()` never raises for anything the candidate does; it raises `TaskError` only when the task is
unusable. Every outcome, including hangs and crashes, is an `EvalResult` with `error.stage` set. An
`infrastructure` failure (the sandbox or interpreter is broken) is returned but never stored.
"""

from __future__ import annotations

import base64
import json
import math
import time
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, Field

from maxkernel.tools import taskcode
from maxkernel.tools.candidate import (
    JUDGE_COMPILE,
    OUTPUTS_FILE,
    PROGRAMS_FILE,
    STAGE_AWAIT_INPUTS,
    STEPWISE_SUFFIX,
    checked_program_file,
    output_name,
    pick_interpret_compile,
    stepwise_name,
    tpu_program_file,
)
from maxkernel.tools.checks import check_pallas_does_work
from maxkernel.tools.evaluation import compare, summarise, with_reference
from maxkernel.tools.judge import (
    EXPECTED_FILE,
    INPUTS_FILE,
    JUDGED_FILE,
    PRECISE_FILE,
    STAGE_INPUTS_READY,
    STAGE_JUDGE_RUN,
)
from maxkernel.tools.program_tree import same_program, skeleton
from maxkernel.tools.readback import (
    MAX_JSON_BYTES,
    ReadBackError,
    bounded_json,
    load_arrays,
    read_capped,
    remove_tree,
)
from maxkernel.tools.reference_cache import REFERENCE_ESTIMATES, TASK_INPUTS, TASK_INPUTS_FILE
from maxkernel.tools.results import (
    CANDIDATE_STAGES,
    REFUSED_FOR_DEVICE,
    STAGE_INFO,
    ArraySpec,
    CompileOutcome,
    CorrectnessResult,
    EstimateSummary,
    EvalResult,
    GenerationEstimate,
    InputConfig,
    MeasuredTiming,
    SetCheck,
    StageError,
    first_lines,
)
from maxkernel.tools.sandbox import (
    SandboxedChild,
    SandboxLimits,
    SandboxOutcome,
    accelerator_present,
    fresh_run_dir,
    machine_load_factor,
    task_read_paths,
)
from maxkernel.tools.store import ResultsStore, evaluation_key, sha256_text
from maxkernel.tools.tasks import KernelTask
from maxkernel.tools.tpu_specs import DEFAULT_GENERATIONS, first_generation, get_spec

TIMEOUT_FLOOR_S = 60.0
TIMEOUT_CEILING_S = 600.0
INTERPRET_ALLOWANCE = 3.0
"""How many times its predicted interpret-mode time an evaluation may take before it is stopped."""
LARGER_SET_WEIGHT = 3.0
"""The larger-shape check costs at most this many validation sets (`validation_sizing.Budget.larger_factor`)."""
COMPILE_BUDGET_S = 20.0
"""Seconds per TPU generation (trace, export and Mosaic compile) in the derived default timeout."""
REFERENCE_ESTIMATE_BUDGET_S = 60.0
"""Seconds per TPU generation the judge gets on top of the evaluation's timeout while the compiler's estimate
of the reference at the task's own shapes is not cached (one XLA compile of the whole program: 40-75 s on an
idle machine for a large 3-D convolution or MoE layer, 150-200 s under load), stretched by the machine's
load. Without it the first evaluation of such a task timed out in the judge's warm-up on every attempt, and
the estimate, computed only once an evaluation survives, was never stored."""
MAX_PROGRAM_BYTES = 64 << 20
MAX_ARRAY_FILE_BYTES = 4 << 30
POLL_S = 0.02
LARGER_MEMORY_FRACTION = 8
INTERPRET_SLOW_RATIO = 25.0
INTERPRET_SLOW_FLOOR_S = 5.0
"""An interpret-mode run over INTERPRET_SLOW_RATIO x the judge's reference time (and over the floor, so that
noise on tiny tasks says nothing) is reported as an interpret-cost warning."""
"""The larger-shape check runs only when the reference's inputs and outputs there fit in this fraction of
the evaluation's memory limit (the judge holds them, the candidate's interpreter holds them again)."""
CANDIDATE_PRELOAD = (
    "numpy",
    "jax",
    "jax.numpy",
    "jax.export",
    "jax.experimental.pallas",
    "jax.experimental.pallas.tpu",
    "jax._src.pallas.hlo_interpreter",
    "jax._src.pallas.mosaic.interpret.interpret_pallas_call",
    "ml_dtypes",
    "ctypes",
    "zipfile",
    "encodings.cp437",  # zipfile decodes member names with it (np.load of the inputs), lazily
    "maxkernel.tools.candidate",
    "maxkernel.tools.program_artifacts",
    "maxkernel.tools.program_tree",
    "maxkernel.tools.taskcode",
    "maxkernel.tools.estimate",
)
"""Imported before the candidate's process may drop to nobody (fallback, root agent): after the drop the
interpreter's own files can be out of reach."""


class EvalOptions(BaseModel):
    """Everything that changes an evaluation's outcome is here, and so in its key."""

    tpu: list[str] = Field(
        default_factory=lambda: list(DEFAULT_GENERATIONS), description="TPU generations to AOT-compile for"
    )
    input_sets: int = Field(3, ge=1, description="input sets per configuration: the task's own + fresh draws")
    seed: int = Field(
        0, description="a salt in the key: another value forces a fresh evaluation. The draws themselves "
        "come from a per-evaluation secret and are never reproducible from it",
    )  # fmt: skip
    timing: bool = Field(True, description="measure on a real device when one is present")
    estimate: bool = Field(True, description="estimate TPU time (block model vs the compiler's cost model)")
    timeout_s: float | None = Field(
        None, description="wall-clock limit for the whole evaluation; None: derived from the task"
    )
    memory_mb: int = 12_000
    larger_shape: bool = Field(
        True, description="also check one secret input set at a second, larger shape (the validation shapes "
        "grown x2 towards the task's own) when it fits in memory",
    )  # fmt: skip
    allow_unsandboxed: bool = Field(
        False,
        description="run the candidate even without bubblewrap (the offline author's kernels; a user's "
        "explicit --allow-unsandboxed). Not part of the key: it decides whether it runs, not the outcome",
    )

    zygote: bool = Field(
        True,
        description="fork the judge and the candidate from pre-imported zygotes (`maxkernel.tools.zygote`) "
        "instead of spawning fresh interpreters. Not part of the key: same checks, same sandbox, less waiting",
    )

    def key_fields(self) -> dict[str, object]:
        # Limits do not change a finished result's content, only whether it finished; keep them in the key
        # anyway so a timeout under a short limit is not served to a caller with a longer one.
        return self.model_dump(mode="json", exclude={"allow_unsandboxed", "zygote"})


class EvalJob(BaseModel):
    """One evaluation to run, whatever runs it: all it needs, as plain data (a Ray worker gets it as JSON)."""

    key: str = Field(description="the store key (`evaluation_key`): also the run dir's name")
    task: KernelTask
    source: str
    options: EvalOptions
    timeout_s: float
    cached_reference_estimates: dict[str, float] = Field(
        default_factory=dict,
        description="the compiler's estimate of the reference per generation, when known",
    )
    work_dir: str = Field(description="absolute; run dirs go under work_dir/evals")
    keep_run_dir: bool = False


class EvalRunner(Protocol):
    """Where an evaluation job runs: `run_job` in this process when there is none, a Ray worker with
    `cluster.RayRunner`. A runner returns the job's result; it never writes the store."""

    def run(self, job: EvalJob) -> EvalResult: ...


def run_job(job: EvalJob) -> EvalResult:
    """Run one evaluation from scratch (no store): both sandboxed children, and the verdict decided here."""
    eval_dir = fresh_run_dir(Path(job.work_dir) / "evals", job.key[:16])
    try:
        return _run(job.task, job.source, sha256_text(job.source), job.options, job.timeout_s, eval_dir,
                    job.cached_reference_estimates)  # fmt: skip
    finally:
        if not job.keep_run_dir:
            remove_tree(eval_dir)


def default_timeout(task: KernelTask, options: EvalOptions, *, load_factor: float | None = None) -> float:
    """A hang should cost about a minute, not ten: the task's reference time (measured when it was
    loaded, compile included) for every input set, plus a compile budget per generation, stretched by the
    machine's current load, in [60, 600] s."""
    derived = (
        30.0
        + COMPILE_BUDGET_S * max(1, len(options.tpu))
        + 10.0 * task.reference_seconds * options.input_sets
    )
    # The candidate's interpret-mode runs, as the validation sizing predicted them (every set and the
    # larger check), with room for a kernel slower than the prediction: a task that had to be validated
    # over its budget gets the time it needs rather than the ceiling.
    interpret = INTERPRET_ALLOWANCE * task.predicted_set_seconds * (options.input_sets + LARGER_SET_WEIGHT)
    factor = machine_load_factor() if load_factor is None else load_factor
    ceiling = max(TIMEOUT_CEILING_S, (30.0 + interpret) * factor)
    return float(min(ceiling, max(TIMEOUT_FLOOR_S, (derived + interpret) * factor)))


def reference_estimate_allowance(n_uncached: int, *, load_factor: float | None = None) -> float:
    """Extra seconds for the judge (only) while `n_uncached` generations' reference estimates are computed."""
    if n_uncached <= 0:
        return 0.0
    factor = machine_load_factor() if load_factor is None else load_factor
    return REFERENCE_ESTIMATE_BUDGET_S * n_uncached * factor


def evaluate(
    task: KernelTask,
    source: str,
    options: EvalOptions | None = None,
    *,
    store: ResultsStore | None = None,
    work_dir: Path | None = None,
    keep_run_dir: bool = False,
    runner: EvalRunner | None = None,
) -> EvalResult:
    """Look the evaluation up in the store, else run it (here, or through `runner`: a Ray cluster, see
    `cluster.RayRunner`) and store what it decided. Only this process writes the store."""
    options = options or EvalOptions()
    source_hash = sha256_text(source)
    key = evaluation_key(task.fingerprint, source_hash, options.key_fields())
    if store is not None:
        hit = store.get_evaluation(key)
        if hit is not None:
            hit.cached = True
            return hit
        store.put_candidate(source_hash, task.task_id, source, origin="eval")
    t0 = time.monotonic()
    cached = {g: _cached_reference_estimate(task, g, options, store) for g in estimate_generations(options)}
    job = EvalJob(
        key=key,
        task=task,
        source=source,
        options=options,
        timeout_s=options.timeout_s or default_timeout(task, options),
        cached_reference_estimates={g: s for g, s in cached.items() if s is not None},
        work_dir=str(Path(work_dir or Path.cwd() / ".maxkernel").resolve()),
        keep_run_dir=keep_run_dir,
    )
    result = runner.run(job) if runner is not None else run_job(job)
    for gen, est in (result.estimate.by_generation if result.estimate else {}).items():
        if est.reference_estimated_seconds:  # computed once per task and generation, then served from here
            REFERENCE_ESTIMATES.put(task, gen, est.reference_estimated_seconds)
            if store is not None:
                store.put_reference_estimate(task.fingerprint, gen, est.reference_estimated_seconds)
    if store is not None and STAGE_INFO[result.error.stage if result.error else "timing"].cached:
        store.put_evaluation(key, task.fingerprint, options.key_fields(), result, time.monotonic() - t0)
        store.log_execution(key, task.task_id)
    return result


def estimate_generations(options: EvalOptions) -> list[str]:
    """The generations an evaluation estimates: every requested one (the block model is cheap; the
    reference's compiler estimate is one compile per task and generation, cached), the first being the
    headline figure; none without `estimate`."""
    if not options.estimate:
        return []
    return list(dict.fromkeys(options.tpu)) or [first_generation(options.tpu)]


def _cached_reference_estimate(
    task: KernelTask, gen: str, options: EvalOptions, store: ResultsStore | None
) -> float | None:
    """The compiler's estimate of the reference from an earlier evaluation of the same task: the store's,
    else this process's (`reference_cache`); None when it must be computed."""
    if not options.estimate:
        return None
    stored = store.get_reference_estimate(task.fingerprint, gen) if store is not None else None
    return stored if stored is not None else REFERENCE_ESTIMATES.get(task, gen)


def larger_config(task: KernelTask, options: EvalOptions) -> tuple[InputConfig | None, str]:
    """The second, larger shape the candidate is checked at: the first validation config with
    every dimension grown by `taskcode.grow_dim` towards the task's own config, or None and why not.

    Pure shape arithmetic (no task code runs here); the output shapes are the validation outputs' under the
    same map, for the memory budget only: the judge computes the reference's real ones and re-checks."""
    if not options.larger_shape:
        return None, "skipped: not requested"
    if not task.validation_configs or not task.configs:
        return None, "skipped: the task has no configurations"
    if (
        task.larger_config is not None
    ):  # sized with the task's own generator (`validation_sizing.Plan.larger`)
        return _within_larger_budget(task.larger_config, options)
    if task.validation_mode == "knobs":
        return None, "skipped: no larger size fits the validation budget"
    val, own = task.validation_configs[0], task.configs[0]
    if not all(a.dtype.startswith(("float", "bfloat")) for a in val.dynamic):
        return None, "skipped: integer or boolean inputs (index-like values cannot be drawn at other shapes)"
    mapping = taskcode.larger_map(val.dynamic, own.dynamic)
    if mapping is None:
        return None, "skipped: the validation and task shapes do not pair up axis by axis"
    if not mapping:
        return None, "skipped: no validation dimension is smaller than the task's own"
    dynamic, static = taskcode.shrink_config(val.dynamic, val.static, mapping)
    # A static value the task itself keeps at both scales (a group count that happens to equal a
    # validation dim) is not a size: growing it would check the candidate against a different problem.
    if len(own.static) == len(val.static):
        static = [v if v == o else g for v, o, g in zip(val.static, own.static, static, strict=True)]
    outputs, _ = taskcode.shrink_config(val.outputs, [], mapping)
    cfg = InputConfig(dynamic=dynamic, static=static, outputs=outputs, atol=val.atol, rtol=val.rtol)
    return _within_larger_budget(cfg, options)


def _within_larger_budget(cfg: InputConfig, options: EvalOptions) -> tuple[InputConfig | None, str]:
    budget = (options.memory_mb << 20) // LARGER_MEMORY_FRACTION
    need = cfg.input_bytes() + cfg.output_bytes()
    if need > budget:
        return None, (f"skipped: {cfg.describe()} needs {need >> 20} MiB of inputs and outputs, over the "
                      f"budget of {budget >> 20} MiB (1/{LARGER_MEMORY_FRACTION} of the memory limit)")  # fmt: skip
    return cfg, ""


PRECISE_COPIES = 2
"""Float32 runs of the reference the judge keeps per low-precision float output (`judge.PRECISE_FILE`: the
reference widened to float32, and the same with every op rounded as the program says)."""


def _set_bytes(c: InputConfig) -> int:
    """One input set on disk: its inputs and outputs, and the judge's float32 copies of each low-precision
    float output (a bf16 conv output of 16 MiB has 64 MiB of them beside it)."""
    wide = sum(PRECISE_COPIES * a.size * 4 for a in c.rounding_checked_outputs())
    return c.input_bytes() + c.output_bytes() + wide


def _output_cap(task: KernelTask, options: EvalOptions, larger: InputConfig | None) -> int:
    """RLIMIT_FSIZE for both children: room for every input or output set (the judge's float32 copies of
    low-precision outputs included), and for logs. Sized from the inputs and outputs alone, the judge's
    `precise.npz` of a bf16 task whose outputs dwarf its inputs overran it, and the evaluation ended as
    "the judge (reference) failed: File too large" - the machine's limit charged to the task."""
    per_set = sum(_set_bytes(c) for c in task.validation_configs)
    extra = 2 * _larger_set_bytes(task, larger) if larger is not None else 0
    return max(64, (2 * per_set * options.input_sets + extra >> 20) + 32)


def _larger_set_bytes(task: KernelTask, larger: InputConfig) -> int:
    """`_set_bytes` of the larger check, whose output shapes are the validation outputs' mapped dim by dim
    (`larger_config`): an output dim that is not an input dim (a transposed convolution's 2n + 1) keeps
    its validation size there, though the judge's real output grows with the inputs. So each output is
    counted at least as grown as the inputs are (a 3-D transposed convolution checked at 2x every dim
    wrote 8x the bytes the mapped shape said, over the file cap: "File too large")."""
    mapped = _set_bytes(larger)
    if not task.validation_configs:
        return mapped
    val = task.validation_configs[0]
    growth = larger.input_bytes() / max(1, val.input_bytes())
    grown = val.output_bytes() * growth + sum(
        PRECISE_COPIES * a.size * 4 * growth for a in val.rounding_checked_outputs()
    )
    return max(mapped, larger.input_bytes() + int(grown))


def _run(
    task: KernelTask,
    source: str,
    source_hash: str,
    options: EvalOptions,
    timeout: float,
    eval_dir: Path,
    cached_ref: dict[str, float],
) -> EvalResult:
    cand_dir, judge_dir = eval_dir / "candidate", eval_dir / "judge"
    cand_dir.mkdir()
    judge_dir.mkdir(mode=0o700)
    candidate_path = cand_dir / "candidate.py"
    candidate_path.write_text(source)
    device = options.timing and accelerator_present()
    larger, larger_note = larger_config(task, options)
    file_mb = _output_cap(task, options, larger)
    task_json = task.model_dump(mode="json")
    interpret_compile = [pick_interpret_compile(c, options.input_sets) for c in task.validation_configs]
    lowering = get_spec(first_generation(options.tpu))
    larger_json = larger.model_dump(mode="json") if larger is not None else None
    task_inputs = TASK_INPUTS.get(task)  # the task's own sets from an earlier evaluation: not secret
    if task_inputs is not None:
        (judge_dir / TASK_INPUTS_FILE).write_bytes(task_inputs)
    uncached = [g for g in estimate_generations(options) if g not in cached_ref]
    judge_timeout = timeout + reference_estimate_allowance(len(uncached))
    judge = SandboxedChild(
        "maxkernel.tools.judge:judge_job",
        {
            "task": task_json,
            "input_sets": options.input_sets,
            "seed": options.seed,
            "larger": larger_json,
            "larger_budget_bytes": (options.memory_mb << 20) // LARGER_MEMORY_FRACTION,
            "task_inputs": TASK_INPUTS_FILE if task_inputs is not None else None,
            "tpu": options.tpu,
            "reference_estimate_generations": uncached,
        },
        judge_dir,
        SandboxLimits(
            timeout_s=judge_timeout,
            memory_mb=options.memory_mb,
            file_mb=file_mb,
            allow_device=device,
            fallback_as_nobody=False,
        ),
        read_paths=task_read_paths(task.reference_path),
        stdin=True,
        zygote_root=eval_dir.parent if options.zygote else None,
    )
    cand = SandboxedChild(
        "maxkernel.tools.candidate:candidate_job",
        {
            "candidate_path": str(candidate_path),
            "configs": task_json["configs"],
            "validation_configs": task_json["validation_configs"],
            "input_sets": [options.input_sets] * len(task.validation_configs),
            "larger_config": larger_json,
            "estimate_generations": estimate_generations(options),
            "interpret_compile": interpret_compile,
            # the TPU the exports are lowered for (the few Mosaic rules that ask which chip they target)
            "lowering_device": [lowering.device_kind, 1],
        },
        cand_dir,
        SandboxLimits(
            timeout_s=timeout,
            memory_mb=options.memory_mb,
            file_mb=file_mb,
            allow_unsandboxed=options.allow_unsandboxed,
        ),
        stdin=True,
        preload=CANDIDATE_PRELOAD,
        zygote_root=eval_dir.parent if options.zygote else None,
    )
    result = EvalResult(task_id=task.task_id, source_hash=source_hash)
    judge.start()
    cand.start()
    try:
        result = _orchestrate(task, options, judge, cand, result, time.monotonic() + judge_timeout + 5,
                              cached_ref, device, larger_note)  # fmt: skip
        return result
    finally:
        cand.kill()
        judge.kill()


def _fail(result: EvalResult, stage: str, message: str) -> EvalResult:
    result.error = StageError(stage=stage, message=message)  # type: ignore[arg-type]
    result.accepted = False
    return result


def _orchestrate(
    task: KernelTask,
    options: EvalOptions,
    judge: SandboxedChild,
    cand: SandboxedChild,
    result: EvalResult,
    deadline: float,
    cached_ref: dict[str, float],
    device: bool,
    larger_note: str,
) -> EvalResult:
    # Phase 1: the judge draws and computes the reference while the candidate loads and traces.
    while time.monotonic() < deadline:
        judge_ready = judge.reached(STAGE_INPUTS_READY)
        if not judge_ready and not judge.running():
            break
        cand_ready = cand.reached(STAGE_AWAIT_INPUTS)
        if not cand_ready and not cand.running():
            break  # the candidate failed before it had a program: no need to wait for the reference
        if judge_ready and cand_ready:
            break
        time.sleep(POLL_S)
    judge_ready = judge.reached(STAGE_INPUTS_READY)
    result.isolation = cand.isolation or judge.isolation
    if not cand.reached(STAGE_AWAIT_INPUTS) and (judge_ready or not cand.running()):
        judge.kill()
        return _candidate_failure(result, cand.wait(deadline), timeout=cand.limits.timeout_s)
    if not judge_ready:
        cand.kill()
        return _judge_failure(result, judge.wait(deadline), options.memory_mb)

    # Phase 2: the candidate's programs are fixed now; read them before it gets any input.
    try:
        programs = _read_programs(cand.run_dir, task)
        blobs = [
            read_capped(cand.run_dir / tpu_program_file(i), MAX_PROGRAM_BYTES) if err is None else None
            for i, err in enumerate(programs["export_errors"])
        ]
        checked_blobs = [
            read_capped(cand.run_dir / checked_program_file(i), MAX_PROGRAM_BYTES) if err is None else None
            for i, err in enumerate(programs["checked_errors"])
        ]
    except (ReadBackError, ValueError, KeyError, TypeError, RecursionError) as exc:
        cand.kill()
        judge.send(b"")
        return _fail(result, "sandbox", f"malformed read-back from the candidate's process: {exc}")
    checks = _check_trees(task, programs, result)
    if not any("violation" in e for e in cand.events()):  # a violation is reported first: wait for it
        try:
            early = _tree_failure(task, result, programs)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            return _fail(result, "sandbox", f"malformed read-back from the candidate's process: {exc}")
        if early is not None:
            _record_seconds(early, programs.get("seconds"))
            early.warnings.append("stopped before the TPU compile and the interpret-mode run: the program "
                                  "trees already decide the verdict")  # fmt: skip
            return early
    expected_kernels = checks[0].pallas_calls if checks else None
    request = {
        "programs": [base64.b64encode(b).decode() if b is not None else None for b in blobs],
        "checked": [base64.b64encode(b).decode() if b is not None else None for b in checked_blobs],
        "tpu": options.tpu,
        "expected_kernels": expected_kernels,
        "timing": device,
    }
    try:
        inputs = read_capped(judge.run_dir / INPUTS_FILE, MAX_ARRAY_FILE_BYTES)
    except ReadBackError as exc:
        return _fail(result, "infrastructure", f"the judge's inputs could not be read: {exc}")
    # The candidate first: its programs were read above, and the judge may still be busy with its warm-up
    # (a request larger than the pipe's buffer would block this process until the judge reads it).
    t_run = time.monotonic()
    cand.send(inputs)
    judge.send(json.dumps(request).encode() + b"\n", close=False)
    cand_out = cand.wait(deadline)
    interpret_s = time.monotonic() - t_run  # measured here, not reported by the candidate
    cand.kill()  # its reaper is gone only when every descendant is: nothing of it outlives this line
    judge.send(b"release\n")
    judge_out = judge.wait(deadline)
    if not judge_out.ok or judge_out.value is None or not judge_out.value.get("ok"):
        return _judge_failure(result, judge_out, options.memory_mb)
    if judge_out.value.get("task_inputs") == "computed":  # the judge's bytes, read before the candidate ran
        TASK_INPUTS.learn(task, inputs, judge_out.value.get("origins"))
    result.stage_seconds["correctness"] = round(interpret_s, 4)
    cand_seconds = (cand_out.value or {}).get("seconds") if cand_out.ok else None
    if isinstance(cand_seconds, dict):  # the candidate's own report, for the breakdown only
        _record_seconds(result, {"interpret_compile": cand_seconds.get("interpret_compile")})
    _interpret_cost_signal(result, interpret_s, judge_out.value.get("seconds"))
    try:
        result = _verdict(task, options, result, programs, checks, cand, cand_out, judge_out.value,
                          cached_ref, larger_note)  # fmt: skip
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        return _fail(result, "sandbox", f"malformed read-back from the candidate's process: {exc}")
    _say_how_interpreted(result, cand.payload)
    return result


def _say_how_interpreted(result: EvalResult, payload: dict[str, Any]) -> None:
    """Which interpret modes and compiles ran per program (the agent's own choices): every validation
    config in the judge's plain interpreter and in the candidate's TPU interpret mode, the larger check in
    the judge's plain interpreter only."""
    corr = result.correctness
    if corr is None:
        return
    corr.interpret_compile = list(payload.get("interpret_compile") or [])
    corr.interpret_modes = ["plain+tpu"] * len(corr.interpret_compile)
    if corr.larger is not None:
        corr.interpret_modes.append("plain")
        corr.interpret_compile.append(JUDGE_COMPILE)


def _interpret_cost_signal(result: EvalResult, interpret_s: float, judge_seconds: Any) -> None:
    """A candidate whose interpret-mode run is far slower than the reference's (hundreds of tiny grid
    steps) is named so: on a TPU each grid step costs ~0.35 us, and the search should not breed it."""
    ref_s = judge_seconds.get("reference") if isinstance(judge_seconds, dict) else None
    if not isinstance(ref_s, int | float) or ref_s <= 0:
        return
    ratio = interpret_s / ref_s
    if interpret_s > INTERPRET_SLOW_FLOOR_S and ratio > INTERPRET_SLOW_RATIO:
        result.warnings.append(
            f"interpret cost: the interpret-mode run took {interpret_s:.1f} s, {ratio:.0f}x the reference's "
            f"{ref_s:.2f} s on the same input sets (measured): likely many tiny grid steps, slow on a TPU too"
        )


MACHINE_LOWERING_SIGNS = ("Unsupported TPU device kind", "Unsupported TPU chip version")
"""A lowering for the TPU that failed because of the machine doing it (the device kind it was asked for is
unknown to this JAX), never because of the kernel: returned as infrastructure, never stored."""
OUT_OF_MEMORY_SIGNS = ("mmap error: 12", "Cannot allocate memory", "std::bad_alloc", "MemoryError", "ENOMEM")
"""What a process that hit its address-space limit (RLIMIT_AS) leaves in its stderr: libtpu's allocator
(`low_level_alloc.cc ... RAW: mmap error: 12`), libc, C++ and Python."""


def _judge_failure(result: EvalResult, outcome: SandboxOutcome, memory_mb: int | None = None) -> EvalResult:
    """Blame the judge's death on what it was doing. Up to its warm-up it runs the task's code (the
    reference; its XLA cost estimate at the task's own shapes): the task's failure. In its compile stage
    it compiles the candidate's TPU program, which is the candidate's: a compiler that runs out of memory
    or time on a program is that program's compile failure, which the author can repair (smaller blocks),
    not a dead task (an MoE kernel whose Mosaic compile needed over 12 GB was reported as "the judge
    (reference) failed" on every attempt)."""
    if outcome.infrastructure:
        return _fail(result, "infrastructure", f"the judge could not run: {outcome.error}")
    value = outcome.value or {}
    if outcome.ok and value.get("stage") == "toolchain":  # this machine's fault: never stored as a verdict
        return _fail(result, "infrastructure", f"the judge could not compile: {value.get('message')}")
    if outcome.ok and value.get("stage") == "task":
        return _fail(result, "task", str(value.get("message")))
    if outcome.violations:
        return _fail(result, "task", "the task's code did something the sandbox forbids: "
                     + "; ".join(outcome.violations))  # fmt: skip
    oom = any(sign in outcome.stderr_tail or sign in (outcome.error or "") for sign in OUT_OF_MEMORY_SIGNS)
    limit = f" (the evaluation's memory limit is {memory_mb} MB)" if memory_mb else ""
    if outcome.stage == "compile" and not outcome.ok:
        if outcome.timed_out:
            return _fail(result, "compile", "the TPU compile of the candidate's program did not finish in time "
                         f"({outcome.error})")  # fmt: skip
        what = f"ran out of memory{limit}" if oom else "died"
        return _fail(result, "compile", f"the TPU compiler {what} compiling the candidate's program (in the "
                     f"judge's compile stage): {first_lines(outcome.error or '', 3)}")  # fmt: skip
    if outcome.timed_out and outcome.stage == STAGE_INPUTS_READY:
        # the harness's own work on trusted code (the reference's compiler estimate, the compiler warm-up) ran
        # out of time, on a loaded machine: nothing about the candidate, so never stored as its verdict
        return _fail(result, "infrastructure", "the judge did not finish the reference's XLA cost estimate at "
                     f"the task's own shapes, or the TPU compiler's warm-up, in time: {outcome.error}")  # fmt: skip
    if outcome.stage == STAGE_JUDGE_RUN and (outcome.timed_out or oom):
        # running the candidate's checked program: its interpreted run was too slow or too large at the
        # validation shapes, which the candidate (fewer, larger grid steps) or the user can change
        what = "did not finish in time" if outcome.timed_out else f"ran out of memory{limit}"
        return _fail(result, "correctness", "the judge's run of the candidate's checked program (interpret mode, "
                     f"at the validation shapes) {what}: {first_lines(outcome.error or '', 3)}; a kernel with "
                     "fewer grid steps interprets faster, and `--timeout` or a smaller `--scale` give it room")  # fmt: skip
    if outcome.timed_out:
        return _fail(result, "task", f"the judge did not finish the reference in time: {outcome.error}")
    if oom:
        return _fail(result, "task", f"the judge ran out of memory{limit} running the reference (stage "
                     f"{outcome.stage}): {first_lines(outcome.error or '', 3)}")  # fmt: skip
    return _fail(result, "task", f"the judge (reference) failed: {outcome.error or value}")


def _candidate_stage(outcome: SandboxOutcome) -> str:
    stage = outcome.stage
    if stage in CANDIDATE_STAGES:
        return stage
    if stage == STAGE_AWAIT_INPUTS:
        return "correctness"
    return "load"


def _candidate_failure(result: EvalResult, outcome: SandboxOutcome, *, timeout: float) -> EvalResult:
    if outcome.violations:
        return _fail(result, "sandbox", "sandbox violation: " + "; ".join(outcome.violations))
    if outcome.infrastructure:
        return _fail(result, "infrastructure", outcome.error or "the candidate's process could not start")
    stage = _candidate_stage(outcome)
    value = outcome.value or {}
    if outcome.ok and value.get("stage") in ("load", "trace"):  # the only stages it may name itself
        return _fail(result, str(value["stage"]), str(value.get("message", ""))[:4000])
    if outcome.timed_out:
        return _fail(result, stage, f"{stage} stage {outcome.error}")
    return _fail(result, stage, outcome.error or "the candidate's process failed")


def _read_programs(run_dir: Path, task: KernelTask) -> dict[str, Any]:
    data = bounded_json(read_capped(run_dir / PROGRAMS_FILE, MAX_JSON_BYTES))
    if not isinstance(data, dict):
        raise ValueError("programs.json is not an object")
    val, prod, errs = data.get("validation"), data.get("production"), data.get("export_errors")
    checked = data.get("checked_errors")
    if not all(isinstance(x, list) for x in (val, prod, errs, checked)):
        raise ValueError("programs.json lacks its lists")
    n_val = len(task.validation_configs)
    if (
        len(val) != n_val
        or len(prod) != len(task.configs)
        or len(errs) != len(prod)
        or len(checked) != n_val + 1
    ):
        raise ValueError("programs.json has the wrong number of programs")
    larger = data.get("larger")
    for entry in [*val, *prod, *([larger] if larger is not None else [])]:
        if not isinstance(entry, dict) or not isinstance(entry.get("tree"), dict):
            raise ValueError("a program entry is malformed")
        if not isinstance(entry.get("out"), list):
            raise ValueError("a program entry is malformed")
    data["export_errors"] = [None if e is None else str(e)[:20_000] for e in errs]
    data["checked_errors"] = [None if e is None else str(e)[:20_000] for e in checked]
    error = data.get("larger_trace_error")
    data["larger_trace_error"] = None if error is None else str(error)[:4000]
    return data


def _check_trees(task: KernelTask, programs: dict[str, Any], result: EvalResult) -> list[Any]:
    """Pallas-does-the-work on every interpret-mode trace; the first failing check is the one reported."""
    checks = []
    for entry in programs["validation"]:
        check, warnings = check_pallas_does_work(entry["tree"])
        checks.append(check)
        for w in warnings:
            if w not in result.warnings:
                result.warnings.append(w)
    failing = [c for c in checks if not c.ok]
    result.pallas = failing[0] if failing else (checks[0] if checks else None)
    result.uses_pallas = bool(checks) and not failing
    return checks


def _verdict(
    task: KernelTask,
    options: EvalOptions,
    result: EvalResult,
    programs: dict[str, Any],
    checks: list[Any],
    cand: SandboxedChild,
    cand_out: SandboxOutcome,
    judge: dict[str, Any],
    cached_ref: dict[str, float],
    larger_note: str,
) -> EvalResult:
    _record_seconds(result, programs.get("seconds"))
    _record_seconds(result, judge.get("seconds"))
    if cand_out.violations:
        return _fail(result, "sandbox", "sandbox violation: " + "; ".join(cand_out.violations))

    failure = _tree_failure(task, result, programs)
    if failure is not None:
        return failure

    # What ships: the judge's reading of the exported TPU program, and its compile.
    for ci, tc in enumerate(judge.get("tpu_checks") or []):
        if isinstance(tc, dict) and not tc.get("ok") and programs["export_errors"][ci] is None:
            result.uses_pallas = False
            return _fail(result, "pallas", f"in the program compiled for the TPU: {tc.get('reason')}")
    # What was checked is what ships: the checked programs' platform sites are their kernels, and their
    # kernels are the shipped program's at other shapes (the judge's reading of both).
    for ci, info in enumerate(judge.get("checked") or []):
        if isinstance(info, dict) and not info.get("ok") and programs["checked_errors"][ci] is None:
            what = "the larger check shape" if ci == len(task.validation_configs) else "the validation shapes"
            return _fail(result, "consistency", f"the checked program at {what}: {info.get('reason')}")
    if judge.get("consistency"):
        return _fail(
            result, "consistency", "what was checked is not what ships: " + str(judge["consistency"])
        )
    export_error = next((e for e in programs["export_errors"] if e), None)
    machine = next((e for e in [*programs["export_errors"], *programs["checked_errors"]]
                    if e and any(sign in e for sign in MACHINE_LOWERING_SIGNS)), None)  # fmt: skip
    if machine:
        return _fail(
            result, "infrastructure", f"this machine could not lower the program for the TPU: {machine}"
        )
    for gen in options.tpu:
        if export_error:
            result.tpu_compile[gen] = CompileOutcome(
                ok=False, error=f"lowering for the TPU failed: {export_error}"
            )
        else:
            result.tpu_compile[gen] = CompileOutcome.model_validate(
                (judge.get("tpu_compile") or {}).get(gen)
                or {"ok": False, "error": "the judge did not compile it"}
            )
    result.compiled = all(o.ok for o in result.tpu_compile.values())
    if not options.tpu:
        result.warnings.append("no TPU generation requested: compiled means lowered for interpret mode only")

    _correctness(task, options, result, cand, cand_out, judge, larger_note, programs)
    failed = [g for g, o in result.tpu_compile.items() if not o.ok]
    if result.error is not None:
        return result
    if failed:
        first = result.tpu_compile[failed[0]].error or ""
        if first.startswith(REFUSED_FOR_DEVICE):  # compiles, but the judge's audit says it is wrong there
            return _fail(result, "compile", first_lines(first, 6))
        return _fail(
            result, "compile", f"Mosaic compile failed for {', '.join(failed)}: {first_lines(first, 6)}"
        )
    assert result.correctness is not None
    if not result.correctness.ok:
        bad = next((s for s in result.correctness.sets if not s.ok), result.correctness.larger)
        assert bad is not None
        if bad is result.correctness.larger:
            return _fail(result, "correctness", bad.message or "wrong at the larger check shape")
        return _fail(result, "correctness",
                     f"config {bad.config} input set {bad.input_set} ({bad.origin}): {bad.message}")  # fmt: skip

    if options.estimate:
        result.estimate = _estimate_summary(
            options, programs.get("estimates"), judge, cached_ref, result.warnings
        )
    if options.timing:
        timing = judge.get("timing")
        if timing:
            result.timing = MeasuredTiming.model_validate(timing)
            if not result.timing.rechecked_correct:
                return _fail(
                    result, "timing", "on the device, the TPU program's outputs do not match the reference"
                )
        else:
            result.warnings.append("timing: no TPU/GPU here, nothing was measured")
    result.accepted = result.correct and result.uses_pallas and result.compiled
    if not result.accepted:
        return _fail(result, "compile", "not compiled for every requested TPU generation")
    return result


def _tree_failure(task: KernelTask, result: EvalResult, programs: dict[str, Any]) -> EvalResult | None:
    """The verdicts the candidate's program trees decide alone, cheapest first: the outputs'
    shapes from the abstract trace, then Pallas on the traces, then one program across modes and shapes.
    Checked as soon as the trees are read, so a kernel that fails here costs no TPU compile and no
    interpret-mode run; `_verdict` asks again (same function) when a violation made it wait."""
    for ci, (cfg, entry) in enumerate(zip(task.validation_configs, programs["validation"], strict=True)):
        got = [_spec(o) for o in entry["out"]]
        if got != list(cfg.outputs):
            return _fail(result, "trace", "output shapes/dtypes differ from the reference: got "
                         + ", ".join(map(str, got)) + "; expected " + ", ".join(map(str, cfg.outputs))
                         + (f" (config {ci})" if ci else ""))  # fmt: skip
    if result.pallas is not None and not result.pallas.ok:
        return _fail(result, "pallas", result.pallas.reason or "Pallas does not do the work")
    # One trace per shape: the interpret-mode program and the TPU program are derived from the same jaxpr, so
    # there is no second trace at a shape to compare. Across shapes the program must stay the same.
    for ci, entry in enumerate(programs["validation"]):
        prod = programs["production"][ci]["tree"]
        diff = same_program(skeleton(entry["tree"]), skeleton(prod), exact=False)
        if diff:
            return _fail(result, "consistency", "the program at the validation shapes is not the one at the "
                         f"task's own shapes ({diff}): a kernel must not branch on shape")  # fmt: skip
        prod_check, _ = check_pallas_does_work(prod)
        if not prod_check.ok:
            return _fail(result, "pallas", f"at the task's own shapes: {prod_check.reason}")
    larger = programs.get("larger")
    if larger is not None and programs["validation"]:
        diff = same_program(
            skeleton(programs["validation"][0]["tree"]), skeleton(larger["tree"]), exact=False
        )
        if diff:
            return _fail(result, "consistency", "the program at the larger check shape is not the one at the "
                         f"validation shapes ({diff}): a kernel must not branch on shape")  # fmt: skip
    return None


def _record_seconds(result: EvalResult, seconds: Any) -> None:
    for name, secs in (seconds or {}).items() if isinstance(seconds, dict) else ():
        if isinstance(secs, int | float):
            result.stage_seconds[str(name)[:40]] = round(float(secs), 4)


def _spec(o: Any) -> ArraySpec:
    if not isinstance(o, dict):
        raise ValueError("an output spec is malformed")
    return ArraySpec(shape=tuple(int(d) for d in o.get("shape", [])), dtype=str(o.get("dtype")))


def _correctness(
    task: KernelTask,
    options: EvalOptions,
    result: EvalResult,
    cand: SandboxedChild,
    cand_out: SandboxOutcome,
    judge: dict[str, Any],
    larger_note: str = "",
    programs: dict[str, Any] | None = None,
) -> None:
    """Compare, here in numpy, the outputs of the judge's own run of the checked programs (the evidence)
    with the judge's expected outputs, and the candidate's TPU-interpret-mode outputs (a cross-check: an
    input set passes only when both match). A malformed read-back or a dead candidate is a failed set, never
    an exception."""
    programs = programs or {}
    val: list[InputConfig] = task.validation_configs
    origins = judge.get("origins") or [["task"] + ["random"] * (options.input_sets - 1)] * len(val)
    correctness = CorrectnessResult(ok=True, scale=task.validation_note, larger_check=larger_note)
    correctness.shapes_used = [c.describe() for c in val]
    if judge.get("task_inputs") in ("computed", "cached"):
        correctness.task_inputs = judge["task_inputs"]
    larger_cfg, larger_note = _judged_larger(task, judge, larger_note)
    correctness.larger_check = larger_note
    result.correctness = correctness
    n_sets = options.input_sets
    n = len(val)
    if not cand_out.ok:
        stage = _candidate_stage(cand_out)
        msg = cand_out.error or "the candidate's process failed"
        if stage != "correctness":
            _fail(result, stage, msg)
            return
        correctness.sets.append(SetCheck(config=0, input_set=0, origin="task", ok=False, message=msg))
        summarise(correctness)
        return
    specs = {output_name(ci, si, k): spec for ci, cfg in enumerate(val)
             for si in range(n_sets) for k, spec in enumerate(cfg.outputs)}  # fmt: skip
    larger_specs = {output_name(n, 0, k): spec for k, spec in enumerate(larger_cfg.outputs)} \
        if larger_cfg is not None else {}  # fmt: skip
    # What the judge ran: every set of a program, up to the set it failed on.
    judged_errors = judge.get("judged_errors") if isinstance(judge.get("judged_errors"), dict) else {}
    ran_until: dict[int, int] = {}
    for ci in range(n + (larger_cfg is not None)):
        err = judged_errors.get(str(ci))
        upto = (n_sets if ci < n else 1) if not isinstance(err, dict) else err.get("set")
        ran_until[ci] = upto if isinstance(upto, int) else 0
    judged_specs = {
        k: v for k, v in {**specs, **larger_specs}.items() if _index(k)[1] < ran_until[_index(k)[0]]
    }
    # What the candidate's process ran (validation configs only), up to its first failure.
    value = cand_out.value or {}
    run_error = value.get("run_error")
    stop = None
    if isinstance(run_error, dict):
        try:
            stop = (int(run_error["config"]), int(run_error["input_set"]))
        except (KeyError, TypeError, ValueError):
            stop = (0, 0)
    cand_specs = {k: v for k, v in specs.items() if stop is None or _index(k) < stop}
    judge_dir = Path(judge_dir_of(cand))
    try:
        want = load_arrays(judge_dir / EXPECTED_FILE, MAX_ARRAY_FILE_BYTES, {**specs, **larger_specs})
        judged = load_arrays(judge_dir / JUDGED_FILE, MAX_ARRAY_FILE_BYTES, judged_specs)
        listed = judge.get("precise") if isinstance(judge.get("precise"), list) else []
        all_specs = {**specs, **larger_specs}
        precise = load_arrays(
            judge_dir / PRECISE_FILE,
            MAX_ARRAY_FILE_BYTES,
            {k: ArraySpec(shape=list(all_specs[base].shape), dtype="float32") for k in listed
             if isinstance(k, str) and (base := k.removesuffix(STEPWISE_SUFFIX)) in all_specs},
        ) if listed and (judge_dir / PRECISE_FILE).is_file() else {}  # fmt: skip
    except ReadBackError as exc:  # the judge's own files: the harness is broken, not the candidate
        _fail(result, "infrastructure", f"the judge's outputs could not be read: {exc}")
        return
    try:
        got = load_arrays(cand.run_dir / OUTPUTS_FILE, MAX_ARRAY_FILE_BYTES, cand_specs)
    except ReadBackError as exc:
        correctness.sets.append(
            SetCheck(config=0, input_set=0, origin="task", ok=False, message=f"unusable outputs: {exc}")
        )
        summarise(correctness)
        result.correct = False
        return
    checked_errors = programs.get("checked_errors") or []

    def judged_check(ci: int, si: int, cfg: InputConfig, origin: str) -> SetCheck:
        if si >= ran_until[ci]:
            err = judged_errors.get(str(ci)) or {}
            message = str(err.get("message", "the judge did not run this set"))[:4000]
            if ci < len(checked_errors) and checked_errors[ci]:
                message = f"the checked program could not be lowered: {checked_errors[ci][:4000]}"
            return SetCheck(config=ci, input_set=si, origin=origin, ok=False, message=message)  # type: ignore[arg-type]
        g = [judged[output_name(ci, si, k)] for k in range(len(cfg.outputs))]
        w = [want[output_name(ci, si, k)] for k in range(len(cfg.outputs))]
        return compare(g, w, cfg, ci, si, origin, *exact(ci, si, len(cfg.outputs)))

    def exact(ci: int, si: int, n_out: int) -> tuple[list[Any], list[Any]]:
        return ([precise.get(output_name(ci, si, k)) for k in range(n_out)],
                [precise.get(stepwise_name(ci, si, k)) for k in range(n_out)])  # fmt: skip

    for ci, cfg in enumerate(val):
        for si in range(n_sets):
            origin = origins[ci][si] if ci < len(origins) and si < len(origins[ci]) else "random"
            check = judged_check(ci, si, cfg, origin)
            if check.ok:  # the candidate's own run must agree (it also catches memory hazards)
                if stop is not None and (ci, si) >= stop:
                    msg = str(run_error.get("message", "the candidate failed on this input set"))[:4000]
                    check = SetCheck(config=ci, input_set=si, origin=origin, ok=False,
                                     message=f"in TPU interpret mode: {msg}")  # fmt: skip
                else:
                    g = [got[output_name(ci, si, k)] for k in range(len(cfg.outputs))]
                    w = [want[output_name(ci, si, k)] for k in range(len(cfg.outputs))]
                    cross = compare(g, w, cfg, ci, si, origin, *exact(ci, si, len(cfg.outputs)))
                    if not cross.ok:
                        cross.message = f"in TPU interpret mode (the candidate's own run): {cross.message}"
                        check = cross
            correctness.sets.append(check)
    if larger_cfg is not None:
        trace_error = programs.get("larger_trace_error")
        if trace_error:
            check = SetCheck(config=n, input_set=0, origin="random", ok=False,
                             message=f"at the larger check shape: {trace_error}")  # fmt: skip
        else:
            check = judged_check(n, 0, larger_cfg, "random")
            if check.message:
                check.message = f"at the larger check shape {larger_cfg.describe()}: {check.message}"
        correctness.larger = check
    summarise(correctness)
    result.max_abs_err, result.max_rel_err = correctness.max_abs_err, correctness.max_rel_err
    result.correct = correctness.ok


def _judged_larger(task: KernelTask, judge: dict[str, Any], note: str) -> tuple[InputConfig | None, str]:
    """The larger check's configuration with the reference's own output shapes, as the judge computed them,
    when the judge drew and ran it; else None and why not (the agent's reason, or the judge's)."""
    info = judge.get("larger")
    if not isinstance(info, dict):
        return None, note or "skipped: the judge did not run it"
    if not info.get("ran"):
        return None, f"skipped: {str(info.get('reason', 'the judge did not run it'))[:400]}"
    try:
        cfg = InputConfig.model_validate(info["config"])
    except (KeyError, ValueError) as exc:
        return None, f"skipped: the judge's larger configuration is malformed: {exc}"
    return cfg, f"ran at {cfg.describe()} (one secret input set)"


def judge_dir_of(cand: SandboxedChild) -> Path:
    return cand.run_dir.parent / "judge"


def _index(name: str) -> tuple[int, int]:
    c, rest = name[1:].split("s", 1)
    return int(c), int(rest.split("o", 1)[0])


def _estimate_summary(
    options: EvalOptions,
    cand_ests: Any,
    judge: dict[str, Any],
    cached_ref: dict[str, float],
    warnings: list[str] | None = None,
) -> EstimateSummary:
    """Per estimated generation: the candidate's block model (from its process: checked for type here)
    against the reference's compiler estimate (cached, else the judge's); the first is the headline."""
    cand_ests = cand_ests if isinstance(cand_ests, dict) else {}
    judged = judge.get("reference_estimated_seconds")
    judged = judged if isinstance(judged, dict) else {}
    gens = estimate_generations(options)
    withheld = _audit_claims(cand_ests, judge.get("kernel_audit"), gens)
    head_error = cand_ests.get(gens[0], {}).get("error") if isinstance(cand_ests.get(gens[0]), dict) else None
    if not withheld and isinstance(head_error, str) and head_error.startswith("estimate withheld"):
        withheld = head_error[:400]  # the block model itself found no price (say so, as for the audit's)
        cand_ests = {g: {"error": withheld} for g in gens}
    if withheld:
        cand_ests = {g: {"error": withheld} for g in gens}
        if warnings is not None:
            warnings.append(withheld)
    failed = judge.get("reference_estimate_errors")
    failed = failed if isinstance(failed, dict) else {}
    compiles = judge.get("tpu_compile") if isinstance(judge.get("tpu_compile"), dict) else {}
    summaries = {
        g: _generation_summary(
            g, cand_ests.get(g), cached_ref.get(g, judged.get(g)), failed.get(g), _relayout_bytes(compiles, g)
        )
        for g in gens
    }
    head = summaries[gens[0]]
    head.by_generation = {
        g: GenerationEstimate(
            estimated_seconds=s.estimated_seconds,
            reference_estimated_seconds=s.reference_estimated_seconds,
            estimated_speedup=s.estimated_speedup,
            bound=s.bound,
            note=s.note,
        )
        for g, s in summaries.items()
    }
    return head


def _audit_claims(cand_ests: dict[str, Any], audit: Any, gens: list[str]) -> str | None:
    """Why every claimed estimate is withheld (None: none is). The block model runs in the candidate's
    process, so its figures are claims; the judge's audit of the shipped Mosaic kernels gives floors no
    honest estimate goes below (`mosaic_audit`). One contradicted generation withholds them all: the
    process that made them is not to be believed."""
    from maxkernel.tools.mosaic_audit import ProgramAudit, contradiction, unpriceable
    from maxkernel.tools.tpu_specs import get_spec

    claimed = {g: c for g, c in cand_ests.items() if g in gens and isinstance(c, dict) and "error" not in c}
    withheld = any(isinstance(c, dict) and str(c.get("error", "")).startswith("estimate withheld") for c in
                   cand_ests.values())  # fmt: skip
    if not claimed and not withheld:
        return None
    try:
        trusted = ProgramAudit.model_validate(audit)
    except ValueError:
        trusted = ProgramAudit(error="the judge returned no audit")
    reason = unpriceable(trusted)
    if reason:  # the judge's own reading says why, whatever the candidate's process reported
        return f"estimate withheld: {reason} (read off the TPU program it shipped)"
    for gen, claim in claimed.items():
        reason = contradiction(claim, trusted, get_spec(gen))
        if reason:
            return (
                "estimate withheld: the block-model figures reported by the candidate's process contradict the "
                f"TPU program it shipped ({reason})"
            )
    return None


def _relayout_bytes(compiles: dict[str, Any], gen: str) -> float:
    """The judge's count of relayout copies before the kernels at the task's shapes (0 when unknown)."""
    outcome = compiles.get(gen)
    value = outcome.get("relayout_bytes") if isinstance(outcome, dict) else None
    return float(value) if isinstance(value, int | float) and math.isfinite(value) and value > 0 else 0.0


def _generation_summary(
    gen: str, cand_est: Any, reference_s: Any, failure: Any = None, relayout_bytes: float = 0.0
) -> EstimateSummary:
    from maxkernel.tools.tpu_specs import get_spec

    summary = EstimateSummary(generation=gen, method="")
    notes = []
    if isinstance(cand_est, dict) and "error" not in cand_est:
        v = cand_est.get("estimated_seconds")
        summary.estimated_seconds = float(v) if isinstance(v, int | float) else None
        if summary.estimated_seconds is not None and relayout_bytes:
            # read off the compiled program by the judge: the block model prices the kernels as they read
            # their inputs, not the copy the compiler makes first when an input's TPU layout differs
            extra = relayout_bytes / get_spec(gen).device_hbm_bytes_per_s
            summary.estimated_seconds += extra
            notes.append(
                f"includes {relayout_bytes / 1e6:.4g} MB of relayout copies ({extra * 1e6:.4g} us) the compiler "
                "puts before the kernels: an input's TPU default layout is not the row-major one they read"
            )
        summary.bound = str(cand_est.get("bound"))[:40] if cand_est.get("bound") else None
        summary.method = str(cand_est.get("method", ""))[:400] + (
            " (computed in the candidate's process; not below the floors the judge read off the shipped kernels)"
        )
        summary.detail_markdown = str(cand_est.get("detail_markdown", ""))[:20_000]
    elif isinstance(cand_est, dict):
        notes.append(str(cand_est["error"])[:400])
    else:
        notes.append("the candidate's process reported no block-model estimate")
    reference_s = float(reference_s) if isinstance(reference_s, int | float) else None
    if reference_s is None:
        why = str(failure)[:400] if isinstance(failure, str) and failure else ""
        notes.append(f"reference cost model failed ({gen}): {why}" if why else "reference cost model failed")
    return with_reference(summary, reference_s, notes)
