"""reflect: read the round's results and decide — iterate with a new plan hint, or stop.

The stop rule is the graph's, not the author's alone: the iteration budget, the model-call/token/wall-time
budgets, and patience (rounds without improvement) all end the run; the author may also say stop.
"""

from __future__ import annotations

from typing import Any, Literal

from langgraph.runtime import Runtime

from maxkernel.authors.base import Attempt as AuthorAttempt
from maxkernel.authors.base import AuthorError
from maxkernel.graph.context import Context
from maxkernel.graph.state import AgentState
from maxkernel.nodes.common import author_context, author_for, budget_exhausted, usage_of, usage_update


def reflect(state: AgentState, runtime: Runtime[Context]) -> dict[str, Any]:
    ctx = runtime.context
    author = author_for(ctx)
    before = usage_of(author)
    no_gain = 0 if state.improved else state.rounds_without_gain + 1
    update: dict[str, Any] = {"rounds_without_gain": no_gain, "improved": False}
    stop = None
    if state.iteration >= state.budgets.max_iterations:
        stop = f"iteration budget spent ({state.iteration}/{state.budgets.max_iterations})"
    elif no_gain >= state.budgets.patience:
        stop = f"no improvement for {no_gain} round(s)"
    elif (spent := budget_exhausted(state)) is not None:
        stop = spent
    if stop is None:
        history = [AuthorAttempt.model_validate(a.model_dump()) for a in state.attempts]
        try:
            decision = author.reflect(author_context(state, ctx), history)
        except AuthorError as exc:
            decision = None
            update["errors"] = [f"reflect: {exc}"]
        if decision is not None:
            if decision.action == "stop":
                stop = "author: " + ("; ".join(decision.reasons) or "nothing left to try")
            else:
                # ONE strategy for the next round, chosen once: the author's when it names one, else the
                # profile's (offline author, or a model that left it open). The plan prompt gets only it.
                strategy = decision.next_strategy or next_strategy(state)
                update["feedback"] = decision.plan_hint or ""
                update["tried_strategies"] = [state.strategy] if state.strategy else []
                update["strategy"] = strategy
        update.update(usage_update(state, author, before))
    if stop:
        update["stop_reason"] = stop
    return update


# What the profile says limits the best kernel → strategies that attack that limit, in order.
BOUND_STRATEGIES: dict[str, tuple[str, ...]] = {
    "memory": ("larger_tiles", "cache_reused_block", "full_k_panel", "fuse_chain", "bf16_operands"),
    "overhead": ("larger_tiles", "full_k_panel", "fuse_chain"),
    "compute": ("mxu_shaped_tiles", "bf16_operands", "cheap_transcendentals", "remove_redundant_work"),
}


def next_strategy(state: AgentState) -> str | None:
    """Pick the next round's strategy from the best kernel's bound class (measured or estimated), skipping
    strategies this run already applied."""
    best = state.best
    if best is None or best.estimated_bound is None:
        return None
    tried = {state.strategy, *state.tried_strategies}  # the current round's strategy counts as tried
    for name in BOUND_STRATEGIES.get(best.estimated_bound, ()):
        if name not in tried:
            return name
    return None


def route_after_reflect(state: AgentState) -> Literal["plan", "finalize"]:
    return "finalize" if state.stop_reason else "plan"
