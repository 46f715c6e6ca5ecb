"""plan: the author proposes the next kernel; in hitl mode a human approves, replaces or rejects it."""

from __future__ import annotations

from typing import Any, Literal

from langgraph.runtime import Runtime
from langgraph.types import Command, interrupt
from pydantic import BaseModel, ValidationError

from maxkernel.authors.base import AuthorError
from maxkernel.graph.context import Context
from maxkernel.graph.state import AgentState, HumanFeedback
from maxkernel.nodes.common import author_context, author_for, usage_of, usage_update


class PlanReview(BaseModel):
    """Resume value for a plan review."""

    action: Literal["approve", "replace", "reject"]
    plan: str | None = None
    feedback: str | None = None


# LangChain's agent inbox (HumanInterrupt / HumanResponse): which of our actions each response type means,
# and which resume field an `edit` response's args fill. None: that response type is not offered.
INBOX_ACTIONS: dict[str, dict[str, str | None]] = {
    "PlanReview": {"accept": "approve", "edit": "replace", "response": "reject", "ignore": None},
    "CodeReview": {"accept": "approve", "edit": "edit", "response": "feedback", "ignore": None},
    "FailureReview": {"accept": "retry", "edit": None, "response": "feedback", "ignore": "stop"},
}
INBOX_EDIT_FIELD = {"PlanReview": "plan", "CodeReview": "code"}


def inbox_request(schema: str, description: str, args: dict[str, Any]) -> dict[str, Any]:
    """The keys an agent inbox / chat UI renders as an action card (added to our own payload)."""
    offered = INBOX_ACTIONS[schema]
    return {
        "action_request": {"action": schema, "args": args},
        "config": {
            "allow_accept": offered["accept"] is not None,
            "allow_edit": offered["edit"] is not None,
            "allow_respond": offered["response"] is not None,
            "allow_ignore": offered["ignore"] is not None,
        },
        "description": description,
    }


def from_inbox(value: Any, schema: type[BaseModel]) -> Any:
    """An agent-inbox response ([{"type": "accept" | "edit" | "response" | "ignore", "args": ...}]) as our
    resume value; anything else is returned as is."""
    if isinstance(value, list) and value and isinstance(value[0], dict):
        value = value[0]
    if not (isinstance(value, dict) and value.get("type") in ("accept", "edit", "response", "ignore")):
        return value
    action = INBOX_ACTIONS.get(schema.__name__, {}).get(value["type"])
    if action is None:
        raise ValueError(f"a {value['type']!r} response does not answer a {schema.__name__}")
    args = value.get("args")
    if value["type"] == "edit":
        edited = (args or {}).get("args", args) if isinstance(args, dict) else {}
        return {
            "action": action,
            INBOX_EDIT_FIELD[schema.__name__]: edited.get(INBOX_EDIT_FIELD[schema.__name__]),
        }
    if value["type"] == "response":
        return {"action": action, "feedback": str(args or "")}
    return {"action": action}


def validated(value: Any, schema: type[BaseModel]) -> BaseModel:
    try:
        return schema.model_validate(from_inbox(value, schema))
    except ValidationError as exc:
        raise ValueError(f"invalid resume value for {schema.__name__}: {exc}") from exc


def plan(state: AgentState, runtime: Runtime[Context]) -> Command[Literal["implement", "plan", "finalize"]]:
    ctx = runtime.context
    author = author_for(ctx)
    before = usage_of(author)
    iteration = state.iteration + 1
    try:
        proposal = author.plan(author_context(state, ctx))
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
    if not proposal.supported:
        reason = proposal.unsupported_reason or "unsupported"
        return Command(
            goto="finalize",
            update={**update, "plan": proposal, "stop_reason": f"unsupported: {reason}", "errors": [reason]},
        )
    if state.mode == "hitl":
        review = validated(
            interrupt(
                {
                    "kind": "plan_review",
                    "iteration": iteration,
                    "task_id": state.task.task_id if state.task else None,
                    "plan": proposal.text,
                    "actions": {
                        "approve": {"action": "approve"},
                        "replace": {"action": "replace", "plan": "<new plan text>"},
                        "reject": {"action": "reject", "feedback": "<what to change>"},
                    },
                    **inbox_request(
                        "PlanReview",
                        f"Round {iteration} plan for {state.task.task_id if state.task else 'the task'}: "
                        "accept it, edit it, or respond with what to change.\n\n" + proposal.text,
                        {"plan": proposal.text},
                    ),
                }
            ),
            PlanReview,
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
