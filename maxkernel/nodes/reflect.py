"""reflect: read the round's results and decide — iterate with a new plan hint, or stop.

The stop rule is the graph's, not the author's alone: the iteration budget, the model-call/token/wall-time
budgets, and patience (rounds without improvement) all end the run; the author may also say stop.
"""

from __future__ import annotations

from typing import Any, Literal

from langgraph.runtime import Runtime

from maxkernel.authors.base import AuthorError, BudgetSpent
from maxkernel.context import Context
from maxkernel.nodes.common import author_context, author_for, budget_exhausted, usage_of, usage_update
from maxkernel.state import AgentState


def reflect(state: AgentState, runtime: Runtime[Context]) -> dict[str, Any]:
    ctx = runtime.context
    author = author_for(ctx, state.label)
    before = usage_of(author)
    no_gain = 0 if state.improved else state.rounds_without_gain + 1
    update: dict[str, Any] = {"rounds_without_gain": no_gain, "improved": False}
    stop = None
    if state.iteration >= state.max_iterations:
        stop = f"iteration budget spent ({state.iteration}/{state.max_iterations})"
    elif no_gain >= state.budgets.patience:
        stop = f"no improvement for {no_gain} round(s)"
    elif (spent := budget_exhausted(state)) is not None:
        stop = spent
    if stop is None:
        history = list(state.attempts)
        try:
            decision = author.reflect(author_context(state, ctx), history)
        except BudgetSpent as exc:
            decision, stop = None, str(exc)
        except AuthorError as exc:
            decision = None
            update["errors"] = [f"reflect: {exc}"]
        if decision is not None:
            if decision.action == "stop":
                stop = "author: " + ("; ".join(decision.reasons) or "nothing left to try")
            else:
                # ONE strategy for the next round, chosen once: the author's when it names one (a model's
                # choice wins), else the profile's bound class and the run's history pick among what the
                # author says it can still apply (offline author, or a model that left it open).
                hint = decision.plan_hint or ""
                if decision.next_strategy:
                    strategy: str | None = decision.next_strategy
                else:
                    strategy = next_strategy(state, decision.strategies)
                    if strategy:
                        hint = (hint + " " if hint else "") + f"Next strategy (from the profile): {strategy}."
                if strategy:
                    update["strategy"] = strategy
                    update["tried_strategies"] = [state.strategy] if state.strategy else []
                update["feedback"] = hint
        update.update(usage_update(state, author, before))
    if stop:
        update["stop_reason"] = stop
    return update


# What the profile says limits the best kernel → strategies that attack that limit, in order.
BOUND_STRATEGIES: dict[str, tuple[str, ...]] = {
    "memory": ("larger_tiles", "cache_reused_block", "full_k_panel", "grid_order_reuse", "fuse_chain"),
    "overhead": ("larger_tiles", "full_k_panel", "fuse_chain", "joint_block_search"),
    "compute": ("mxu_shaped_tiles", "joint_block_search", "cheap_transcendentals", "remove_redundant_work"),
}
"""bf16_operands is not listed: feeding the MXU bf16 where the reference asks for f32 loosens precision,
which only a human (or a task tolerance the author has checked) may decide."""


def next_strategy(state: AgentState, allowed: list[str] | None = None) -> str | None:
    """Pick the next round's strategy from the best kernel's bound class (measured or estimated) and from
    what this run already applied.

    `allowed` is what the author says it can still apply (empty: anything). Order of preference: a strategy
    that attacks the bound class and was not tried; then any allowed strategy not tried; then the first
    allowed one again (the author's transforms pick a config not yet evaluated, so a repeat still moves).
    """
    best = state.best
    tried = {state.strategy, *state.tried_strategies}  # the current round's strategy counts as tried
    allow = set(allowed or ())
    bound = best.estimated_bound if best is not None else None
    for name in BOUND_STRATEGIES.get(bound or "", ()):
        if name not in tried and (not allow or name in allow):
            return name
    for name in allowed or ():
        if name not in tried:
            return name
    return allowed[0] if allowed else None


def route_after_reflect(state: AgentState) -> Literal["plan", "finalize"]:
    return "finalize" if state.stop_reason else "plan"
