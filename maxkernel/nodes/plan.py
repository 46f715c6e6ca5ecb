"""plan: the author proposes the next kernel; in hitl mode a human approves, replaces or rejects it."""

from __future__ import annotations

from typing import Any, Literal

from langgraph.runtime import Runtime
from langgraph.types import Command

from maxkernel.authors.base import AuthorError, BudgetSpent
from maxkernel.context import Context
from maxkernel.nodes.common import author_context, author_for, budget_stop, usage_of, usage_update
from maxkernel.nodes.review import PlanReview, ask
from maxkernel.state import AgentState, HumanFeedback


def plan(state: AgentState, runtime: Runtime[Context]) -> Command[Literal["implement", "plan", "finalize"]]:
    ctx = runtime.context
    author = author_for(ctx, state.label)
    before = usage_of(author)
    iteration = state.iteration + 1
    try:
        proposal = author.plan(author_context(state, ctx))
    except BudgetSpent as exc:
        return Command(goto="finalize", update=budget_stop(state, author, before, exc))
    except AuthorError as exc:
        return Command(
            goto="finalize",
            update={
                "stop_reason": f"the author could not plan: {exc}",
                "errors": [str(exc)],
                "iteration": iteration,
                **usage_update(state, author, before),
            },
        )
    update: dict[str, Any] = {"iteration": iteration, "repairs": 0, **usage_update(state, author, before)}
    if state.strategy is None and proposal.strategy:
        # The round had no strategy and the author chose one: that choice is the round's (chosen once; the
        # graph does not pick another, and reflect counts it as tried).
        update["strategy"] = proposal.strategy
    if not proposal.supported:
        reason = proposal.unsupported_reason or "unsupported"
        return Command(
            goto="finalize",
            update={**update, "plan": proposal, "stop_reason": f"unsupported: {reason}", "errors": [reason]},
        )
    if state.mode == "hitl":
        task_id = state.task.task_id if state.task else None
        review = ask(
            "plan_review",
            f"Round {iteration} plan for {task_id or 'the task'}: accept it, edit it, or respond with what to "
            "change.\n\n" + proposal.text,
            iteration=iteration,
            task_id=task_id,
            plan=proposal.text,
        )
        assert isinstance(review, PlanReview)
        record = HumanFeedback(at="plan_review", action=review.action, text=review.plan or review.feedback)
        if review.action == "reject":
            # Plan again with the human's words; the iteration counter does not advance for a rejection.
            return Command(goto="plan", update={"feedback": review.feedback or "", "human": [record]})
        if review.action == "replace":
            if not review.plan:
                raise ValueError("a 'replace' plan review needs the new plan text")
            proposal = proposal.model_copy(
                update={"text": review.plan, "hints": [*proposal.hints, "plan replaced by a human"]}
            )
        update["human"] = [record]
    return Command(goto="implement", update={**update, "plan": proposal})
