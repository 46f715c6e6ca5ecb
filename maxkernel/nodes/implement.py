"""implement: the author writes the kernel; in hitl mode a human approves, edits or sends feedback."""

from __future__ import annotations

from typing import Any, Literal

from langgraph.runtime import Runtime
from langgraph.types import Command

from maxkernel.authors.base import AuthorError, BudgetSpent, ToolRequest
from maxkernel.authors.reply import fenced
from maxkernel.context import Context
from maxkernel.nodes.common import (
    author_context,
    author_for,
    budget_stop,
    current_plan,
    end_tool_conversation,
    save_source,
    usage_of,
    usage_update,
)
from maxkernel.nodes.review import CodeReview, ask
from maxkernel.state import AgentState, HumanFeedback


def implement(
    state: AgentState, runtime: Runtime[Context]
) -> Command[Literal["validate", "implement", "reflect", "model_tools", "finalize"]]:
    ctx = runtime.context
    author = author_for(ctx, state.label)
    before = usage_of(author)
    plan = current_plan(state)
    try:
        draft = author.implement(author_context(state, ctx), plan)
    except BudgetSpent as exc:
        return Command(goto="finalize", update=budget_stop(state, author, before, exc))
    except AuthorError as exc:
        return Command(
            goto="reflect",
            update={
                "errors": [f"implement: {exc}"],
                "feedback": str(exc),
                **usage_update(state, author, before),
                **end_tool_conversation(state),
            },
        )
    if isinstance(draft, ToolRequest):  # the model asked for tools: the tool node answers, then back here
        return Command(
            goto="model_tools",
            update={
                "tool_messages": [draft.message],
                "tool_caller": "implement",
                **usage_update(state, author, before),
            },
        )
    update: dict[str, Any] = {**usage_update(state, author, before), **end_tool_conversation(state)}
    source, kind = draft.source, "implement"
    if state.mode == "hitl":
        review = ask(
            "code_review",
            f"Round {state.iteration} kernel ({plan.summary}): accept it, edit the module, or respond with what "
            "to change.\n\n" + fenced(source, "python"),
            iteration=state.iteration,
            plan=plan.summary,
            code=source,
        )
        assert isinstance(review, CodeReview)
        record = HumanFeedback(at="code_review", action=review.action, text=review.feedback)
        if review.action == "feedback":
            return Command(
                goto="implement", update={**update, "feedback": review.feedback or "", "human": [record]}
            )
        if review.action == "edit":
            if not review.code:
                raise ValueError("an 'edit' code review needs the code")
            source, kind = review.code, "human"
        update["human"] = [record]
    digest, path = save_source(state, source)
    return Command(
        goto="validate",
        update={
            **update,
            "source_hash": digest,
            "source_path": path,
            "source_config": draft.config.as_dict() if draft.config and kind == "implement" else None,
            "repairs": 0,
            "feedback": None,
            "attempt_kind": kind,
        },
    )
