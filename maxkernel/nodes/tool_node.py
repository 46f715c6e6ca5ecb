"""model_tools: the graph's tool node. Runs the tools an implementing (or repairing) model asked for, then
returns to that step, which calls the model again with the answers.

The tools are `authors.model_tools` (API look-up from the installed JAX; a draft check by the sandboxed
harness: a draft is never imported in this process). Each call and its answer are ToolMessages in the
state's `tool_messages`, so they are checkpointed: a resumed run continues the conversation instead of
running a tool again. The step's budget is `Context.model_tools` calls; calls beyond it (a model may ask for
several at once) are answered "not run" so the conversation stays well-formed for the provider.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from langchain_core.messages import AIMessage, ToolMessage
from langgraph.runtime import Runtime
from langgraph.types import Command

from maxkernel.authors.model_tools import tools_for
from maxkernel.context import Context
from maxkernel.nodes.common import store_at, tools_left
from maxkernel.state import AgentState

NOT_RUN = "not run: the tool budget of this step is spent; answer now, without tools"


def model_tools(state: AgentState, runtime: Runtime[Context]) -> Command[Literal["implement", "repair"]]:
    ctx = runtime.context
    if state.tool_caller is None or not state.tool_messages:
        raise RuntimeError(
            "model_tools runs only after a step asked for tools (no tool conversation in state)"
        )
    request = state.tool_messages[-1]
    if not isinstance(request, AIMessage) or not request.tool_calls:
        raise RuntimeError("the last message of the tool conversation asks for no tool")
    assert state.task is not None
    tools = {
        t.name: t for t in tools_for(state.task, list(ctx.tpu), Path(ctx.work_dir), store_at(ctx.store_path))
    }
    left = tools_left(state, ctx)
    answers: list[ToolMessage] = []
    for call in request.tool_calls:
        name = call.get("name", "")
        if left <= 0:
            content = NOT_RUN
        elif name not in tools:
            content = f"unknown tool {name!r}; tools: {', '.join(tools)}"
        else:
            left -= 1
            content = run_tool(tools[name], call.get("args") or {})
        answers.append(ToolMessage(content, tool_call_id=call.get("id") or "", name=name))
    return Command(goto=state.tool_caller, update={"tool_messages": answers})


def run_tool(tool: Any, args: dict[str, Any]) -> str:
    try:
        return str(tool.invoke(args))
    except Exception as exc:  # noqa: BLE001 - a tool's error is an answer for the model, not a crash of the run
        return f"tool error: {type(exc).__name__}: {exc}"
