"""Profile a candidate against its reference, and estimate both on TPU generations.

On a machine without a TPU the profile is what it is: the XLA reference and the *interpreted* kernel timed
on the CPU, labelled as such. That shows where the interpreted program spends its time (which kernel,
which XLA ops around it), not TPU performance. TPU performance comes from the estimates: the block model
of each pallas_call and the TPU compiler's cost model of the reference, per generation — estimates, named
so. The capture runs in the sandbox like every other execution of candidate or task code.

The estimates are the harness's, never the profiling process's: that process has loaded the candidate,
which may have rewritten the block model or the compiler's cost model in it. The harness computes the
reference's estimate in the judge and checks the candidate's block-model claim against the TPU program
the candidate ships (`mosaic_audit`), withholding it when they disagree. The caller passes the
evaluation it already has (the agent's profile node), or the profile evaluates the kernel (a store hit
when it was evaluated before) and shows what the harness decided, a rejection included.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from maxkernel.tools.profile_trace import TraceSummary
from maxkernel.tools.results import EstimateSummary, EvalResult
from maxkernel.tools.sandbox import SandboxLimits, fresh_run_dir, run_sandboxed
from maxkernel.tools.store import sha256_text
from maxkernel.tools.tasks import KernelTask
from maxkernel.tools.tpu_specs import first_generation


class ProfileReport(BaseModel):
    task_id: str
    reference: TraceSummary | None = None
    candidate: TraceSummary | None = None
    estimates: dict[str, EstimateSummary] = Field(
        default_factory=dict, description="per TPU generation: the harness's estimates (judged, audited)"
    )
    estimate_note: str | None = Field(None, description="why estimates are missing, or a rejection")
    error: str | None = None

    def to_markdown(self, *, detail: bool = True) -> str:
        lines = [f"### Profile of {self.task_id}"]
        if self.error:
            lines.append(f"profiling failed: {self.error}")
        if self.reference and self.candidate:
            r, c = self.reference, self.candidate
            per_step = lambda t: t.measured_wall_us / max(t.steps, 1)  # noqa: E731
            lines.append(
                f"Measured on {c.platform}{'' if c.on_tpu else ' (not TPU performance)'}: candidate "
                f"{per_step(c):.0f} us/step ({c.device_label}), reference {per_step(r):.0f} us/step "
                f"({r.device_label})."
            )
        for summary in (self.candidate, self.reference):
            if summary is not None and detail:
                lines += ["", summary.to_markdown()]
        if self.estimate_note:
            lines += ["", f"Estimates: {self.estimate_note}."]
        if self.estimates:
            lines += [
                "",
                "Estimated by the harness (the reference by the judge; the kernel's block model checked "
                "against the TPU program it ships):",
                "",
                "| TPU | estimated candidate | estimated reference | estimated speedup | bound |",
                "| --- | --- | --- | --- | --- |",
            ]
            for gen, e in self.estimates.items():
                cand = f"{e.estimated_seconds * 1e6:.1f} us" if e.estimated_seconds else "—"
                ref = (
                    f"{e.reference_estimated_seconds * 1e6:.1f} us" if e.reference_estimated_seconds else "—"
                )
                sp = f"{e.estimated_speedup:.2f}x" if e.estimated_speedup else "—"
                lines.append(f"| {gen} | {cand} | {ref} | {sp} | {e.bound or '—'} |")
            first = next(iter(self.estimates.values()))
            if detail and first.detail_markdown:
                lines += ["", first.detail_markdown]
            notes = {e.note for e in self.estimates.values() if e.note}
            lines += [f"- note: {n}" for n in sorted(notes)]
        return "\n".join(lines)


def profile_kernel(
    task: KernelTask,
    source: str,
    tpu: list[str],
    work_dir: str | Path,
    *,
    repeats: int = 3,
    evaluation: EvalResult | None = None,
    evaluate_options: Any = None,
    store: Any = None,
) -> ProfileReport:
    """Trace the reference and the interpreted candidate (sandboxed), and attach the harness's estimates:
    `evaluation` when the caller has it, else a harness evaluation of `source` (`evaluate_options`, default
    `EvalOptions(tpu=tpu)`, through `store` when given)."""
    run_dir = fresh_run_dir(Path(work_dir) / "profiles", task.task_id)
    candidate_path = run_dir / "candidate.py"
    candidate_path.write_text(source)
    payload = {
        "task": task.model_dump(mode="json"),
        "candidate_path": str(candidate_path),
        "repeats": repeats,
    }
    outcome = run_sandboxed(
        "maxkernel.tools.profiling:profile_job",
        payload,
        run_dir,
        SandboxLimits(timeout_s=600),
        read_paths=[Path(task.reference_path).parent],
    )
    if not outcome.ok or outcome.value is None:
        return ProfileReport(task_id=task.task_id, error=f"{outcome.stage}: {outcome.error}")
    report = ProfileReport.model_validate(outcome.value)
    report.estimates = {}  # whatever that process said: only the harness's figures are shown
    if evaluation is None:
        from maxkernel.tools.harness import EvalOptions, evaluate

        options = evaluate_options or EvalOptions(tpu=tpu)
        evaluation = evaluate(task, source, options, store=store, work_dir=Path(work_dir))
    report.estimates, report.estimate_note = harness_estimates(evaluation, tpu)
    return report


def harness_estimates(r: EvalResult, tpu: list[str]) -> tuple[dict[str, EstimateSummary], str | None]:
    """Per generation, the estimates the harness reached for `r` (judge-side reference estimate, audited
    block-model claim), and why there are none where there are none."""
    e = r.estimate
    if e is None:
        why = f"{r.error.stage}: {r.error.message}" if r.error else "the evaluation made no estimate"
        return {}, f"no estimate: the harness did not reach one ({why[:300]})"
    out: dict[str, EstimateSummary] = {}
    for gen in tpu:
        g = e.by_generation.get(gen)
        if gen == e.generation:
            out[gen] = e.model_copy(update={"by_generation": {}})
        elif g is not None:
            out[gen] = EstimateSummary(generation=gen, method=e.method, **g.model_dump(exclude={"kind"}))
    note = None if r.accepted else f"the harness rejected this kernel ({r.error.stage if r.error else '?'})"
    return out, note


class _Summaries:
    """Profile summaries of kernels already profiled in this process, by (task, source, generation): a run
    whose best kernel did not change since the last round (a round without gain) profiles the same program
    again, a sandboxed process of tens of seconds, to learn nothing new. Failed profiles are not kept."""

    def __init__(self, max_entries: int = 64) -> None:
        self._entries: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self.max_entries = max_entries

    def get(self, key: str) -> str | None:
        with self._lock:
            return self._entries.get(key)

    def put(self, key: str, summary: str) -> None:
        with self._lock:
            self._entries[key] = summary
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)


PROFILE_SUMMARIES = _Summaries()


def profile_summary(
    task: KernelTask, source_path: str, tpu: list[str], work_dir: str | Path, evaluation: EvalResult
) -> str:
    """Markdown for the reflect prompt and the report (the profile node's tool): the traces only; the node
    shows `evaluation`'s estimates (the harness's) next to it."""
    source = Path(source_path).read_text()
    gen = first_generation(tpu)
    key = sha256_text(json.dumps(["profile summary", task.fingerprint, sha256_text(source), gen]))
    known = PROFILE_SUMMARIES.get(key)
    if known is not None:
        return known
    # One traced run each: on CPU the trace shows where the interpreted program's time goes, which one run
    # tells as well as three, and interpreted kernels are slow.
    report = profile_kernel(task, source, [gen], work_dir, repeats=1, evaluation=evaluation)
    report.estimates, report.estimate_note = {}, None
    summary = report.to_markdown(detail=False)
    if report.error is None:
        PROFILE_SUMMARIES.put(key, summary)
    return summary


# --- worker side ------------------------------------------------------------------------------------------


def profile_job(payload: dict[str, Any], ctx: Any) -> dict[str, Any]:
    import jax
    import numpy as np
    from jax.experimental.pallas import tpu as pltpu

    from maxkernel.tools import taskcode
    from maxkernel.tools.evaluation import bind_static
    from maxkernel.tools.profile_trace import capture_trace, summarize_trace
    from maxkernel.tools.results import InputConfig

    ctx.guard()
    task = payload["task"]
    ctx.stage("task")
    ref = taskcode.Reference.of_task(task)
    val = InputConfig.model_validate(task["validation_configs"][0])
    mode = task["validation_mode"]
    if mode == "shrink":
        rng = np.random.default_rng(0)
        stats = {"min": -1.0, "max": 1.0, "mean": 0.0, "std": 0.5}
        inputs = [jax.numpy.asarray(taskcode.random_from_spec(s, rng, stats)) for s in val.dynamic]
    else:
        inputs = [jax.numpy.asarray(a) for a in taskcode.own_validation_inputs(ref.source, task)[0]]
    traces = Path(ctx.run_dir) / "traces"
    repeats = int(payload.get("repeats", 3))
    ctx.stage("trace")
    ref_dir = capture_trace(
        bind_static(taskcode.reference_for(ref.source, val.knobs).computation, val.static),
        inputs,
        traces,
        label="cpu (XLA reference)",
        repeats=repeats,
    )
    ctx.stage("load")
    module = taskcode.load_module(Path(payload["candidate_path"]), "maxkernel_candidate")
    candidate = taskcode.candidate_entry(module)
    if candidate is None:
        raise taskcode.TaskCodeError("the candidate module has no `computation` or `workload`")
    ctx.stage("trace")
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        cand_dir = capture_trace(
            bind_static(candidate, val.static),
            inputs,
            traces,
            label="cpu (Pallas TPU interpret)",
            repeats=repeats,
        )
    report = ProfileReport(
        task_id=task["task_id"],
        reference=summarize_trace(ref_dir, label="cpu (XLA reference)"),
        candidate=summarize_trace(cand_dir, label="cpu (Pallas TPU interpret)"),
    )
    return report.model_dump(mode="json")
