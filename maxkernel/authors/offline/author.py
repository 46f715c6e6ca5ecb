"""`OfflineAuthor`: writes Pallas TPU kernels from the reference's jaxpr, with no model.

The analysis (tracing the reference, partitioning its jaxpr into kernels, writing kernel bodies) runs in
the sandbox, because the reference is task code; it returns a `ProgramSpec` of plain data. Everything after
that happens here and needs no JAX: choosing block sizes, rendering the module at any config, the plan
text, the tuning space. Deterministic: the same task, strategy and history give the same kernel.

Each round after the first applies a different transform (`transforms.TRANSFORMS`: a strategy realised as a
choice in the tuning space); `reflect` goes on while a transform still leads to a config the run has not
evaluated, and says which ones, so the graph's reflect node can pick among them by the bound class.

Repairs have two levers: smaller blocks (when a compile ran out of VMEM) and less fusion (each fusion level
is a more conservative partition of the same jaxpr; the last one puts every matmul and every reduction in
a kernel of its own).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from maxkernel.authors.base import (
    Attempt,
    AuthorContext,
    AuthorError,
    Draft,
    Plan,
    Reflection,
    TileConfig,
)
from maxkernel.authors.offline.partition import FUSION_LEVELS
from maxkernel.authors.offline.render import plan_text, render, undefined_names
from maxkernel.authors.offline.spec import ProgramSpec
from maxkernel.authors.offline.transforms import applicable, pick, ranked_space, transform_for
from maxkernel.authors.offline.tuning import (
    default_config,
    kernel_values,
    oversized,
    predicted_seconds,
    tuning_space,
    validate,
    vmem_estimate,
)
from maxkernel.tools.sandbox import SandboxLimits, fresh_run_dir, run_sandboxed, task_read_paths

LEVEL_NOTES = (
    "full fusion: epilogues (with row reductions) in matmul kernels, flash attention, shared K loops",
    "no row reductions in matmul epilogues (they get a row-wise kernel of their own); paged K/V gathered by XLA",
    "no row reductions in epilogues, one matmul per kernel",
    "no attention fusion either: every matmul and every reduction in a kernel of its own",
)
VMEM_FAILURE = re.compile(r"RESOURCE_EXHAUSTED|vmem|VMEM|Scoped allocation|would exceed|exceeds? the", re.I)
LEVEL_HINT = re.compile(r"fusion[_ ]level\s*[=:]\s*(\d)")


class OfflineAuthor:
    """Deterministic author; see the module docstring. `plan.data` holds the analysis (a ProgramSpec)."""

    name = "offline"

    def __init__(self, *, timeout_s: float = 300.0) -> None:
        self.timeout_s = timeout_s
        self._cache: dict[tuple[str, int], dict[str, Any]] = {}

    # --- analysis (sandboxed) -------------------------------------------------------------------------
    def analyse(self, ctx: AuthorContext, level: int = 0) -> dict[str, Any]:
        """Run the jaxpr analysis in the sandbox; cached per task fingerprint and fusion level."""
        task = ctx.task
        key = (task.fingerprint, level)
        if key in self._cache:
            return self._cache[key]
        opts = FUSION_LEVELS[level]
        payload = {
            "source": task.source_payload(),
            "task_id": task.task_id,
            "configs": [c.model_dump(mode="json") for c in task.configs],
            "validation_configs": [c.model_dump(mode="json") for c in task.validation_configs],
            "options": {
                "attention": opts.attention,
                "multi_dot": opts.multi_dot,
                "epilogue_reductions": opts.epilogue_reductions,
                "paged": opts.paged,
            },
        }
        # A run dir of its own: search branches analyse the same task concurrently.
        run_dir = fresh_run_dir(Path(ctx.work_dir) / "offline", f"{task.fingerprint[:16]}-{level}")
        outcome = run_sandboxed(
            "maxkernel.authors.offline.analysis_job:analyse_job",
            payload,
            run_dir,
            # the task's own code, as the judge and `describe` run it: without bubblewrap a root agent's child
            # keeps root (a reference in a private folder, as containers keep them, stays readable); no
            # candidate ever runs in this job
            SandboxLimits(timeout_s=self.timeout_s, fallback_as_nobody=False),
            read_paths=task_read_paths(task.reference_path),
        )
        if not outcome.ok:
            # Not cached: a crash or timeout of the analysis is not a fact about the task.
            return {"ok": False, "unsupported": f"the analysis failed ({outcome.stage}): {outcome.error}"}
        result = dict(outcome.value or {})
        self._cache[key] = result
        return result

    # --- the Author protocol --------------------------------------------------------------------------
    def plan(self, ctx: AuthorContext) -> Plan:
        m = LEVEL_HINT.search(ctx.feedback or "")
        level = min(int(m.group(1)), len(FUSION_LEVELS) - 1) if m else 0
        return self.plan_at(ctx, level)

    def plan_at(self, ctx: AuthorContext, level: int, hints: list[str] | None = None) -> Plan:
        result = self.analyse(ctx, level)
        hints = list(hints or [])
        if level:
            hints.append(f"fusion level {level}: {LEVEL_NOTES[level]}")
        program, config = None, None
        if result.get("ok"):
            program = ProgramSpec.model_validate(result["program"])
            config = default_config(program, ctx.tpu)
            too_big = oversized(program, config, ctx.tpu)
            if too_big:
                # refused, not compiled: a compile of such a kernel can outgrow the evaluation's memory
                result = {
                    "ok": False,
                    "unsupported": "a kernel far beyond any TPU's VMEM: " + "; ".join(too_big),
                }
            else:
                try:
                    checked_source(program, config, ctx.tpu)
                except AuthorError as exc:  # refused at the plan: a less fused level may still lower
                    result = {"ok": False, "unsupported": str(exc)}
        if not result.get("ok") or program is None or config is None:
            reason = result.get("task_error") or result.get("unsupported") or "unknown"
            text = (
                f"# Plan: {ctx.task.task_id} — unsupported\n\nThe offline author cannot write a kernel for this "
                f"task: {reason}.\n"
            )
            return Plan(
                family="unsupported",
                summary=f"unsupported: {reason}",
                text=text,
                supported=False,
                unsupported_reason=reason,
                hints=hints,
                data={"level": level, "internal_error": result.get("internal_error")},
            )
        program.task_id = ctx.task.task_id
        space = tuning_space(program, ctx.tpu)
        transform = transform_for(ctx.strategy)
        if transform is not None:
            chosen = pick(transform, program, space, ctx.tpu, _tried_configs(ctx.history))
            if chosen is not None:
                config = chosen
                hints.append(f"transform {transform.strategy}: {transform.why} -> {chosen.label()}")
            else:
                hints.append(f"transform {transform.strategy}: no untried config left; kept the default")
        elif ctx.strategy:
            hints.append(f"strategy {ctx.strategy} has no offline transform; kept the default config")
        return Plan(
            family=program.family,
            summary=program.summary,
            text=plan_text(program, config, ctx.tpu, len(space), hints),
            default_config=config,
            hints=hints,
            data={"program": program.model_dump(mode="json"), "level": level},
        )

    def implement(self, ctx: AuthorContext, plan: Plan) -> Draft:
        program = self._program(plan)
        config = plan.default_config or default_config(program, ctx.tpu)
        return self._draft(ctx, program, config, f"offline author, fusion level {plan.data.get('level', 0)}")

    def render(self, ctx: AuthorContext, plan: Plan, config: TileConfig) -> Draft:
        program = self._program(plan)
        problems = validate(program, config, ctx.tpu)
        if problems:
            raise AuthorError("invalid config: " + "; ".join(problems))
        return self._draft(ctx, program, config, f"config {config.label()}")

    def tuning_space(self, ctx: AuthorContext, plan: Plan) -> list[TileConfig]:
        return tuning_space(self._program(plan), ctx.tpu)

    def repair(
        self, ctx: AuthorContext, plan: Plan, source: str, failure: str, history: list[Attempt]
    ) -> Draft:
        program = self._program(plan)
        tried = {TileConfig.of(a.config) for a in history if a.config}
        if VMEM_FAILURE.search(failure):
            current = plan.default_config or default_config(program, ctx.tpu)
            cur_vmem = sum(vmem_estimate(k, kernel_values(k, current)) for k in program.kernels)
            smaller = [
                c
                for c in tuning_space(program, ctx.tpu)
                if c not in tried
                and c != current
                and sum(vmem_estimate(k, kernel_values(k, c)) for k in program.kernels) < cur_vmem
            ]
            if smaller:
                pick = max(smaller, key=lambda c: _half(c, current))
                return self._draft(ctx, program, pick, "smaller blocks after a VMEM failure")
        level = int(plan.data.get("level", 0))
        for nxt in range(level + 1, len(FUSION_LEVELS)):
            new_plan = self.plan_at(ctx, nxt, hints=[f"repair after: {failure[:200]}"])
            if not new_plan.supported:
                continue
            draft = self.implement(ctx, new_plan)
            if draft.source != source:
                draft.plan_update = new_plan
                draft.notes = f"fused less ({LEVEL_NOTES[nxt]}) after: {failure[:200]}"
                return draft
        raise AuthorError(
            "the offline author has nothing left to try: smallest blocks and least fusion tried"
        )

    def predict_seconds(self, ctx: AuthorContext, plan: Plan, configs: list[TileConfig]) -> list[float]:
        """Coarse predicted TPU time per config (for ranking and pruning the tuning space; not an estimate
        of record: the harness's block model is)."""
        program = self._program(plan)
        return [predicted_seconds(program, c, ctx.tpu) for c in configs]

    def reflect(self, ctx: AuthorContext, history: list[Attempt]) -> Reflection:
        levels = {int(m.group(1)) for a in history for m in [LEVEL_HINT.search(a.message or "")] if m}
        if any(a.accepted for a in history):
            m = LEVEL_HINT.search(ctx.feedback or "")
            level = min(int(m.group(1)), len(FUSION_LEVELS) - 1) if m else max(levels, default=0)
            result = self.analyse(ctx, level)
            if not result.get("ok"):
                return Reflection(action="stop", reasons=["the analysis is no longer available"])
            program = ProgramSpec.model_validate(result["program"])
            space = tuning_space(program, ctx.tpu)
            tried = _tried_configs(history)
            left = applicable(program, space, ctx.tpu, tried)
            if not left:
                evaluated = sum(1 for c, _ in ranked_space(program, space, ctx.tpu) if c in tried)
                return Reflection(
                    action="stop",
                    reasons=[
                        f"every offline transform leads to a kernel already evaluated ({evaluated} of the "
                        f"{len(space)} configs that are not predicted hopeless were tried)"
                    ],
                )
            hint = f"fusion_level={level}" if level else None
            return Reflection(
                action="continue",
                reasons=[f"untried transforms apply: {', '.join(left)}"],
                plan_hint=hint,
                strategies=left,
            )
        nxt = max(levels, default=0) + 1
        if history and nxt < len(FUSION_LEVELS):
            return Reflection(
                action="continue",
                reasons=["no accepted kernel yet; a less fused partition may avoid the failure"],
                plan_hint=f"fusion_level={nxt}",
            )
        return Reflection(action="stop", reasons=["no accepted kernel and no fusion level left to try"])

    # --- helpers --------------------------------------------------------------------------------------
    def _program(self, plan: Plan) -> ProgramSpec:
        if not plan.supported or "program" not in plan.data:
            raise AuthorError(plan.unsupported_reason or "the plan has no program")
        return ProgramSpec.model_validate(plan.data["program"])

    def _draft(self, ctx: AuthorContext, program: ProgramSpec, config: TileConfig, notes: str) -> Draft:
        return Draft(source=checked_source(program, config, ctx.tpu), notes=notes, config=config)


def checked_source(program: ProgramSpec, config: TileConfig, tpu: list[str]) -> str:
    """The module for one config, refused when it reads a name it never defines or imports. Every module
    this author hands out (implement, each autotune config, each repair) comes through here: such a module
    would pass the analysis and fail only when the line runs (`NameError: np`, once, on a TPU), so it is a
    bug of the author's own lowering, reported as such rather than evaluated."""
    source = render(program, config, tpu)
    missing = undefined_names(source)
    if missing:
        raise AuthorError(
            f"the generated module reads names it never defines or imports ({', '.join(missing)}) "
            f"at {config.label()}: a gap in the offline author's lowering, not handed to the harness"
        )
    return source


def _tried_configs(history: list[Attempt]) -> set[TileConfig]:
    return {TileConfig.of(a.config) for a in history if a.config}


def _half(c: TileConfig, ref: TileConfig) -> float:
    """Prefer the config closest to half the current blocks (a gentle step down)."""
    score = 0.0
    for k, v in c.as_dict().items():
        r = ref.get(k)
        if isinstance(v, int) and isinstance(r, int) and r:
            score -= abs(v / r - 0.5)
    return score
