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
                hint = decision.plan_hint or ""
                update["feedback"] = hint
        update.update(usage_update(state, author, before))
    if stop:
        update["stop_reason"] = stop
    return update


def route_after_reflect(state: AgentState) -> Literal["plan", "finalize"]:
    return "finalize" if state.stop_reason else "plan"
