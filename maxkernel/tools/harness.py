"""The evaluation harness, agent side: look the evaluation up, else run it in the sandbox and store it.

`evaluate()` never raises for anything the candidate does; it raises `TaskError` only when the task is
unusable. Every outcome, including hangs and crashes, is an `EvalResult` with `error.stage` set.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

from pydantic import BaseModel, Field

from maxkernel.tools.results import STAGES, EvalResult, StageError
from maxkernel.tools.sandbox import (
    SandboxLimits,
    SandboxOutcome,
    accelerator_present,
    fresh_run_dir,
    run_sandboxed,
)
from maxkernel.tools.store import ResultsStore, evaluation_key, sha256_text, toolchain_versions
from maxkernel.tools.tasks import KernelTask
from maxkernel.tools.tpu_specs import DEFAULT_GENERATIONS, first_generation


class EvalOptions(BaseModel):
    """Everything that changes an evaluation's outcome is here, and so in its key."""

    tpu: list[str] = Field(
        default_factory=lambda: list(DEFAULT_GENERATIONS), description="TPU generations to AOT-compile for"
    )
    input_sets: int = Field(3, ge=1, description="input sets per configuration: the task's own + fresh draws")
    seed: int = 0
    timing: bool = Field(True, description="measure on a real device when one is present")
    estimate: bool = Field(True, description="estimate TPU time (block model vs the compiler's cost model)")
    timeout_s: float = Field(600.0, description="wall-clock limit for the whole evaluation")
    memory_mb: int = 12_000

    def key_fields(self) -> dict[str, object]:
        # Limits do not change a finished result's content, only whether it finished; keep them in the key
        # anyway so a timeout under a short limit is not served to a caller with a longer one.
        return self.model_dump(mode="json")


def evaluate(
    task: KernelTask,
    source: str,
    options: EvalOptions | None = None,
    *,
    store: ResultsStore | None = None,
    work_dir: Path | None = None,
) -> EvalResult:
    options = options or EvalOptions()
    source_hash = sha256_text(source)
    key = evaluation_key(task.fingerprint, source_hash, options.key_fields())
    if store is not None:
        hit = store.get_evaluation(key)
        if hit is not None:
            hit.cached = True
            return hit
        store.put_candidate(source_hash, task.task_id, source, origin="eval")
    run_dir = fresh_run_dir(Path(work_dir or Path.cwd() / ".maxkernel") / "evals", key[:16])
    candidate_path = run_dir / "candidate.py"
    candidate_path.write_text(source)
    worker_opts = options.model_dump(mode="json")
    ref_cache = reference_cache_path(task, options, work_dir)
    if ref_cache.exists():
        worker_opts["reference_cache"] = str(ref_cache)
    gen = first_generation(options.tpu)
    if store is not None and options.estimate:
        worker_opts["reference_estimated_seconds"] = store.get_reference_estimate(task.fingerprint, gen)
    payload = {
        "task": task.model_dump(mode="json"),
        "candidate_path": str(candidate_path),
        "source_hash": source_hash,
        "options": worker_opts,
    }
    t0 = time.monotonic()
    outcome = run_sandboxed(
        "maxkernel.tools.evaluation:evaluate_job",
        payload,
        run_dir,
        SandboxLimits(
            timeout_s=options.timeout_s,
            memory_mb=options.memory_mb,
            allow_device=options.timing and accelerator_present(),
        ),
        read_paths=[Path(task.reference_path).parent, ref_cache.parent],
    )
    _keep_reference_sets(outcome, run_dir, ref_cache)
    result = _to_result(task, source_hash, outcome)
    if store is not None and result.estimate and result.estimate.reference_estimated_seconds:
        store.put_reference_estimate(task.fingerprint, gen, result.estimate.reference_estimated_seconds)
    if store is not None:
        store.put_evaluation(key, task.fingerprint, options.key_fields(), result, time.monotonic() - t0)
        store.log_execution(key, task.task_id)
    return result


def reference_cache_path(task: KernelTask, options: EvalOptions, work_dir: Path | None) -> Path:
    """Input sets and reference outputs depend only on the task, the draw and the toolchain: one file per
    such key, reused by every later candidate of the task (the reference stage then costs a file read)."""
    key = sha256_text(json.dumps([task.fingerprint, options.input_sets, options.seed, toolchain_versions()]))
    path = Path(work_dir or Path.cwd() / ".maxkernel").resolve() / "reference_sets" / f"{key[:24]}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _keep_reference_sets(outcome: SandboxOutcome, run_dir: Path, cache: Path) -> None:
    """Cache the child's reference sets only if the file is byte-for-byte what the harness wrote before the
    candidate was imported (its hash is in the signed result)."""
    value = outcome.value or {}
    digest = value.pop("_reference_sets_sha256", None)
    produced = run_dir / "reference_sets.npz"
    if digest and produced.exists() and hashlib.sha256(produced.read_bytes()).hexdigest() == digest:
        tmp = cache.with_suffix(f".{run_dir.name}.part")
        shutil.copyfile(produced, tmp)
        tmp.replace(cache)
    produced.unlink(missing_ok=True)


def _stage_of(progress_stage: str | None) -> str:
    if progress_stage in STAGES:
        return progress_stage
    if progress_stage == "reference":
        return "task"
    return "load"


def _to_result(task: KernelTask, source_hash: str, outcome: SandboxOutcome) -> EvalResult:
    if outcome.ok and outcome.value is not None:
        value = dict(outcome.value)
        violations = value.pop("_violations", None)
        result = EvalResult.model_validate(value)
        if violations:
            result.accepted = False
            result.error = StageError(stage="sandbox", message="sandbox violation: " + "; ".join(violations))
    else:
        stage = _stage_of(outcome.stage)
        if outcome.violations:
            message = "sandbox violation: " + "; ".join(outcome.violations)
            stage = "sandbox"
        elif outcome.timed_out:
            message = f"{stage} stage {outcome.error}"
        else:
            message = outcome.error or "the evaluation process failed"
        result = EvalResult(
            task_id=task.task_id,
            source_hash=source_hash,
            error=StageError(stage=stage, message=message),  # type: ignore[arg-type]
        )
    result.isolation = outcome.isolation
    return result
