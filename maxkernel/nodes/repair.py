"""repair: the author fixes the kernel from the harness's message and the run's earlier attempts."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from langgraph.runtime import Runtime
from langgraph.types import Command

from maxkernel.authors.base import AuthorError, BudgetSpent, ToolRequest
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
from maxkernel.state import AgentState


def repair(
    state: AgentState, runtime: Runtime[Context]
) -> Command[Literal["validate", "reflect", "model_tools", "finalize"]]:
    ctx = runtime.context
    author = author_for(ctx, state.label)
    before = usage_of(author)
    r = state.eval_result
    assert r is not None and state.source_path
    failure = f"{r.error.stage}: {r.error.message}" if r.error else "not accepted"
    if state.feedback and state.feedback not in failure:
        failure += "\n" + state.feedback
    history = [a for a in state.attempts if a.iteration == state.iteration]
    try:
        draft = author.repair(
            author_context(state, ctx),
            current_plan(state),
            Path(state.source_path).read_text(),
            failure,
            history,
        )
    except BudgetSpent as exc:
        return Command(goto="finalize", update=budget_stop(state, author, before, exc))
    except AuthorError as exc:
        return Command(
            goto="reflect",
            update={
                "errors": [f"repair gave up: {exc}"],
                "repairs": state.repairs + 1,
                **usage_update(state, author, before),
                **end_tool_conversation(state),
            },
        )
    if isinstance(draft, ToolRequest):  # the model asked for tools: the tool node answers, then back here
        return Command(
            goto="model_tools",
            update={
                "tool_messages": [draft.message],
                "tool_caller": "repair",
                **usage_update(state, author, before),
            },
        )
    digest, path = save_source(state, draft.source)
    update = {
        **end_tool_conversation(state),
        "source_hash": digest,
        "source_path": path,
        "source_config": draft.config.as_dict() if draft.config else None,
        "repairs": state.repairs + 1,
        "attempt_kind": "repair",
        **usage_update(state, author, before),
    }
    if draft.plan_update is not None:
        update["plan"] = draft.plan_update  # the author changed approach (e.g. less fusion) to repair
    return Command(goto="validate", update=update)
