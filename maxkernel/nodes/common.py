"""What the nodes share: the author and store for a run, author contexts, kernel files, evaluations.

Nodes stay thin: read state, call an author or a tool through these helpers, return a partial update.
"""

from __future__ import annotations

import hashlib
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

from langgraph.config import get_config

from maxkernel.authors.base import Author, AuthorContext, Plan, RunBudget
from maxkernel.context import AuthorKind, Context
from maxkernel.state import AgentState, Attempt
from maxkernel.tools.cluster import runner_for
from maxkernel.tools.harness import EvalOptions, evaluate
from maxkernel.tools.results import EvalResult
from maxkernel.tools.store import ResultsStore


@lru_cache(maxsize=8)
def store_at(path: str) -> ResultsStore:
    return ResultsStore(path)


_AUTHORS: dict[tuple[Any, ...], Author] = {}


def author_for(ctx: Context, label: str | None = None) -> Author:
    """The run's author, built once per (model, store, call settings, branch label): the offline author when
    `model` is 'offline'. Search branches run concurrently and the nodes charge usage as the difference of the
    author's counters around a call, so each branch gets its own author (and counters) or one branch's tokens
    would be charged to another."""
    settings = ctx.call_settings()
    key = (ctx.model, id(ctx.chat_model), ctx.store_path, settings, label)
    if key not in _AUTHORS:
        kind = ctx.author_kind
        if kind is AuthorKind.OFFLINE:
            _AUTHORS[key] = offline_author(ctx)
        elif kind is AuthorKind.CHAT_MODEL:
            from maxkernel.authors.llm import LLMAuthor

            _AUTHORS[key] = LLMAuthor(
                ctx.chat_model,
                model_name=ctx.model,
                store=store_at(ctx.store_path),
                call_settings=settings,
            )
        else:
            from maxkernel.authors.llm import LLMAuthor

            _AUTHORS[key] = LLMAuthor(ctx.model, store=store_at(ctx.store_path), call_settings=settings)
    return _AUTHORS[key]


def offline_author(ctx: Context) -> Author:
    from maxkernel.authors.offline import OfflineAuthor

    return OfflineAuthor()


def usage_of(author: Author) -> tuple[int, int]:
    """(calls, tokens) already written to a run's state. An author keeps that mark (`recorded`) so calls made
    by a step that then failed (a 429 storm that ended the run) are added by the next step that records,
    instead of being lost with the failed step's update."""
    usage = getattr(author, "usage", None)
    if usage is None:
        return (0, 0)
    mark = getattr(author, "recorded", None)
    return mark if mark is not None else (usage.model_calls, usage.tokens)


def thread_id() -> str:
    try:
        return str(get_config()["configurable"]["thread_id"])
    except (KeyError, RuntimeError):
        return "no-thread"


def author_context(state: AgentState, ctx: Context, *, feedback: str | None = None) -> AuthorContext:
    assert state.task is not None, "prepare must run first"
    starting = Path(state.best.source_path).read_text() if state.best else None
    return AuthorContext(
        task=state.task,
        tpu=list(ctx.tpu),
        work_dir=Path(ctx.work_dir),
        feedback=feedback if feedback is not None else (state.feedback or ""),
        starting_source=starting,
        strategy=state.strategy,
        history=list(state.attempts),
        profile=state.trace_summary,
        plan_text=state.plan.text if state.plan else None,
        tried_strategies=[s for s in (*state.tried_strategies, state.strategy) if s],
        tool_messages=list(state.tool_messages),
        tools_left=tools_left(state, ctx),
        usage_key=usage_key(state),
        budget=run_budget(state),
        refused=list(state.refused_features),
        # Stable when a node re-runs after a resume, different for every new step of the run.
        scope=f"{thread_id()}/{state.label or ''}/{state.iteration}/{len(state.attempts)}/{len(state.human)}",
    )


def current_plan(state: AgentState) -> Plan:
    if state.plan is None:
        raise RuntimeError("no plan in state: the plan node must run before this one")
    return state.plan


def save_source(state: AgentState, source: str) -> tuple[str, str]:
    """Kernel sources live in the run dir, named by hash (state keeps the path)."""
    digest = hashlib.sha256(source.encode()).hexdigest()
    path = Path(state.run_dir or ".") / "candidates" / f"{digest[:16]}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text(source)
    return digest, str(path)


def run_eval(state: AgentState, ctx: Context, source: str) -> EvalResult:
    """Evaluate through the results store: a node re-run after a resume finds the earlier result."""
    assert state.task is not None
    # The offline author's own kernels may run without bubblewrap (fallback); a model's never do.
    options = EvalOptions(
        tpu=list(ctx.tpu),
        input_sets=ctx.input_sets,
        timeout_s=ctx.eval_timeout_s,
        allow_unsandboxed=ctx.is_offline,
    )
    return evaluate(
        state.task,
        source,
        options,
        store=store_at(ctx.store_path),
        work_dir=Path(ctx.work_dir),
        runner=runner_for(ctx.ray_address),
    )


def eval_slots(ctx: Context) -> int:
    """Evaluations a node may have in flight at once: the Ray cluster's capacity, 1 without one (a local
    evaluation already runs two sandboxed children)."""
    runner = runner_for(ctx.ray_address)
    return runner.capacity if runner is not None else 1


def to_attempt(
    state: AgentState, kind: str, digest: str, path: str, r: EvalResult, config: dict[str, Any] | None = None
) -> Attempt:
    est = r.estimate
    return Attempt(
        iteration=state.iteration,
        kind=kind,  # type: ignore[arg-type]
        source_hash=digest,
        source_path=path,
        stage="accepted" if r.accepted else (r.error.stage if r.error else "unknown"),
        message="" if r.accepted else (r.error.message if r.error else ""),
        correct=r.correct,
        compiled=r.compiled,
        uses_pallas=r.uses_pallas,
        accepted=r.accepted,
        config=config,
        estimated_seconds=est.estimated_seconds if est else None,
        estimated_speedup=est.estimated_speedup if est else None,
        estimated_speedup_by_generation={g: e.estimated_speedup for g, e in est.by_generation.items()}
        if est
        else {},
        estimated_bound=est.bound if est else None,
        measured_seconds=r.timing.candidate_median_s if r.timing else None,
        measured_speedup=r.timing.measured_speedup if r.timing else None,
    )


def better(candidate: Attempt, best: Attempt | None) -> bool:
    if not candidate.accepted:
        return False
    if best is None:
        return True
    return candidate.score() > best.score()


def run_budget(state: AgentState) -> RunBudget:
    """The run's model budgets and what it had spent, as an author checks them before every call."""
    b, u = state.budgets, state.usage
    return RunBudget(
        max_model_calls=b.max_model_calls,
        max_tokens=b.max_tokens,
        max_wall_s=b.max_wall_s,
        started_at=u.started_at,
        calls=u.model_calls,
        tokens=u.tokens,
    )


def budget_exhausted(state: AgentState) -> str | None:
    """The budget the run has spent (None: none), named as the author names it when it refuses a call."""
    return run_budget(state).spent(state.usage.model_calls, state.usage.tokens, time.time())


def tools_left(state: AgentState, ctx: Context) -> int:
    """Tool calls the current step may still ask for: `Context.model_tools` per step, none once the run's
    model-call, token or wall-time budget is spent (every tool turn costs a model call)."""
    from langchain_core.messages import ToolMessage

    if budget_exhausted(state) is not None:
        return 0
    used = sum(isinstance(m, ToolMessage) for m in state.tool_messages)
    return max(0, ctx.model_tools - used)


def budget_stop(state: AgentState, author: Author, before: tuple[int, int], reason: object) -> dict[str, Any]:
    """The update of a step that a spent budget stopped before a model call: the budget is the run's stop
    reason (finalize runs next), the calls made so far are recorded, any tool conversation ends."""
    return {"stop_reason": str(reason), **usage_update(state, author, before), **end_tool_conversation(state)}


def end_tool_conversation(state: AgentState) -> dict[str, Any]:
    """The update that clears a finished step's tool conversation (nothing when there is none)."""
    if not state.tool_messages:
        return {}
    from langchain_core.messages import RemoveMessage
    from langgraph.graph.message import REMOVE_ALL_MESSAGES

    return {"tool_messages": [RemoveMessage(id=REMOVE_ALL_MESSAGES)], "tool_caller": None}


def usage_key(state: AgentState) -> str:
    """The key a run's model usage is charged to in the store's ledger: one per thread and search branch."""
    return f"{thread_id()}/{state.label or ''}"


def usage_update(state: AgentState, author: Author, before: tuple[int, int]) -> dict[str, Any]:
    """The state's usage of the model after a step. Calls and tokens: with a store, the ledger's totals for
    this run (every call made, failed ones and those of steps lost to a kill included); else the author's
    counters since `before`. And the features the provider refused in this run (`refused_features`)."""
    update = _refusals_update(state, author)
    usage = getattr(author, "usage", None)
    calls, tokens = (usage.model_calls, usage.tokens) if usage is not None else (0, 0)
    if hasattr(author, "recorded"):
        author.recorded = (calls, tokens)  # type: ignore[attr-defined]
    from maxkernel.authors import usage_ledger

    ledger = usage_ledger.totals(
        getattr(author, "store", None), usage_key(state), since=state.usage.started_at
    )
    if ledger is not None:
        new_calls, new_tokens = ledger
    else:
        new_calls = state.usage.model_calls + calls - before[0]
        new_tokens = state.usage.tokens + tokens - before[1]
    if (new_calls, new_tokens) != (state.usage.model_calls, state.usage.tokens):
        update["usage"] = state.usage.model_copy(update={"model_calls": new_calls, "tokens": new_tokens})
    return update


def _refusals_update(state: AgentState, author: Author) -> dict[str, Any]:
    found = getattr(author, "refusals_for", None)
    refused = set(found(usage_key(state))) if callable(found) else set()
    if refused <= set(state.refused_features):
        return {}
    return {"refused_features": sorted(refused | set(state.refused_features))}
