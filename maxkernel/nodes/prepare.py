"""prepare: load the task (sandboxed), set budgets, and find a correct starting kernel when possible."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from langgraph.runtime import Runtime

from maxkernel.authors.base import AuthorError
from maxkernel.context import Context
from maxkernel.nodes.common import (
    author_context,
    offline_author,
    run_eval,
    save_source,
    thread_id,
    to_attempt,
)
from maxkernel.state import AgentState, Usage
from maxkernel.tools.tasks import TaskError, load_task


def prepare(state: AgentState, runtime: Runtime[Context]) -> dict[str, Any]:
    ctx = runtime.context
    try:
        task = load_task(state.task_path, scale=state.scale, work_dir=Path(ctx.work_dir))
    except TaskError as exc:
        return {"status": "failed", "stop_reason": f"bad task: {exc}", "errors": [str(exc)]}
    run_dir = Path(ctx.work_dir).resolve() / "runs" / f"{task.task_id}-{thread_id()}"
    if state.label:
        run_dir = run_dir / state.label
    run_dir.mkdir(parents=True, exist_ok=True)
    update: dict[str, Any] = {
        "task": task,
        "run_dir": str(run_dir),
        # The context's budgets (CLI flags, Studio settings) override the state's defaults.
        "budgets": state.budgets.model_copy(update=ctx.budget_overrides()),
        "usage": Usage(started_at=time.time()),
    }
    if ctx.max_repairs is not None:
        update["max_repairs"] = ctx.max_repairs
    if state.start_source_path:
        return {**update, **_start_from(state.model_copy(update=update), ctx, Path(state.start_source_path))}
    if ctx.is_offline or not ctx.baseline:
        return update  # the offline author's first round *is* the baseline
    # Any other author starts from the offline author's kernel when it can write one: a correct starting
    # point for the model, and the baseline the run must beat.
    staged = state.model_copy(update=update)
    try:
        author = offline_author(ctx)
        actx = author_context(staged, ctx)
        plan = author.plan(actx)
        if not plan.supported:
            return {**update, "errors": [f"no offline baseline: {plan.unsupported_reason}"]}
        draft = author.implement(actx, plan)
    except AuthorError as exc:
        return {**update, "errors": [f"no offline baseline: {exc}"]}
    digest, path = save_source(staged, draft.source)
    result = run_eval(staged, ctx, draft.source)
    attempt = to_attempt(staged, "baseline", digest, path, result)
    update["attempts"] = [attempt]
    if attempt.accepted:
        update["best"] = attempt
    return update


def _start_from(state: AgentState, ctx: Context, path: Path) -> dict[str, Any]:
    """A given starting kernel (a search parent's) is evaluated as the baseline this run must beat."""
    source = path.read_text()
    digest, saved = save_source(state, source)
    result = run_eval(state, ctx, source)
    attempt = to_attempt(state, "baseline", digest, saved, result)
    update: dict[str, Any] = {"attempts": [attempt]}
    if attempt.accepted:
        update["best"] = attempt
    return update
