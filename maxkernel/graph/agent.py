"""The kernel-engineering loop as a LangGraph graph. This module only wires nodes.

convert (subgraph: PyTorch / CUDA / Triton -> a JAX task; a JAX task passes through) →
prepare → plan → implement → validate → test → autotune → profile → reflect → (plan | finalize)
                    ⇅          ▲   │ fail    │ fail
               model_tools     └ repair ◄────┘          (hitl: on_failure asks a human first)
                    ⇅ (repair too: a model's tool calls run in the tool node, then back to the step)

`validate` and `test` read ONE harness evaluation: `validate` runs it (load, trace, Pallas check, AOT
compile, correctness, estimate and timing in one sandboxed job, cached in the results store) and routes on
the compile stages; `test` re-reads the same `eval_result` and routes on correctness. They are two nodes so
a human (hitl) and the router see "does it compile" and "is it right" as separate steps, not two runs.

Budgets (model calls, tokens, wall time) are checked before every model call; a step that a spent budget
stops (plan, implement, repair) goes to finalize with that budget as the stop reason.

State: `maxkernel.state`; run settings: `maxkernel.context`; checkpoints: `maxkernel.checkpointing`.
"""

from __future__ import annotations

from typing import Any, Literal

from langgraph.graph import END, START, StateGraph

from maxkernel.context import Context
from maxkernel.graph.convert import compile_convert_graph
from maxkernel.nodes.autotune import autotune
from maxkernel.nodes.finalize import finalize
from maxkernel.nodes.implement import implement
from maxkernel.nodes.on_failure import on_failure
from maxkernel.nodes.plan import plan
from maxkernel.nodes.prepare import prepare
from maxkernel.nodes.profile import profile
from maxkernel.nodes.reflect import reflect, route_after_reflect
from maxkernel.nodes.repair import repair
from maxkernel.nodes.test import route_after_test, test
from maxkernel.nodes.tool_node import model_tools
from maxkernel.nodes.validate import route_after_validate, validate
from maxkernel.state import AgentInput, AgentState


def route_after_convert(state: AgentState) -> Literal["prepare", "finalize"]:
    return "finalize" if state.status in ("failed", "stopped") else "prepare"


def route_after_prepare(state: AgentState) -> Literal["plan", "finalize"]:
    return "finalize" if state.task is None else "plan"


def build_graph() -> StateGraph:
    """The agent graph. Model-calling nodes have no LangGraph `RetryPolicy`: `authors.model_calls` is the
    one layer that retries a model call, so a node re-run never multiplies the attempts a user allowed."""
    g = StateGraph(AgentState, context_schema=Context, input_schema=AgentInput)
    g.add_node("convert", compile_convert_graph())
    g.add_node("prepare", prepare)
    g.add_node("plan", plan, destinations=("implement", "plan", "finalize"))
    g.add_node(
        "implement", implement, destinations=("validate", "implement", "reflect", "model_tools", "finalize")
    )
    g.add_node("model_tools", model_tools, destinations=("implement", "repair"))
    g.add_node("validate", validate)
    g.add_node("test", test)
    g.add_node("repair", repair, destinations=("validate", "reflect", "model_tools", "finalize"))
    g.add_node("on_failure", on_failure, destinations=("repair", "finalize"))
    g.add_node("autotune", autotune)
    g.add_node("profile", profile)
    g.add_node("reflect", reflect)
    g.add_node("finalize", finalize)
    g.add_edge(START, "convert")
    g.add_conditional_edges("convert", route_after_convert)
    g.add_conditional_edges("prepare", route_after_prepare)
    g.add_conditional_edges("validate", route_after_validate)
    g.add_conditional_edges("test", route_after_test)
    g.add_edge("autotune", "profile")
    g.add_edge("profile", "reflect")
    g.add_conditional_edges("reflect", route_after_reflect)
    g.add_edge("finalize", END)
    return g


def compile_graph(checkpointer: Any = None) -> Any:
    """A compiled agent graph. With no checkpointer it inherits its caller's when run as a subgraph."""
    return build_graph().compile(checkpointer=checkpointer, name="maxkernel-agent")


# For `langgraph dev` / LangGraph Studio: the server supplies its own checkpointer.
graph = compile_graph()
