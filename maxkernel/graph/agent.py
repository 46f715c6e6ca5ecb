"""The kernel-engineering loop as a LangGraph graph. This module only wires nodes.

prepare → plan → implement → validate → test → autotune → profile → reflect → (plan | finalize)
                               ▲   │ fail    │ fail
                               └ repair ◄────┘          (hitl: on_failure asks a human first)
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any, Literal

from langgraph.graph import END, START, StateGraph
from langgraph.types import RetryPolicy

from maxkernel.graph.context import Context
from maxkernel.graph.state import AgentInput, AgentState
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
from maxkernel.nodes.validate import route_after_validate, validate
from maxkernel.tools.store import enable_wal


def route_after_prepare(state: AgentState) -> Literal["plan", "finalize"]:
    return "finalize" if state.task is None else "plan"


def transient_model_failure(exc: Exception) -> bool:
    """LangGraph's node-level retry: only model failures that waiting can cure (the call-level retries in
    authors.model_calls ran first; this re-runs the node once more after a longer pause)."""
    from maxkernel.authors.model_calls import ModelCallError

    return isinstance(exc, ModelCallError) and exc.transient


# Model-calling nodes get one more try of the whole node after the call-level retries gave up.
MODEL_NODE_RETRY = RetryPolicy(
    initial_interval=5.0,
    backoff_factor=2.0,
    max_interval=60.0,
    max_attempts=2,
    retry_on=transient_model_failure,
)


def build_graph(model_retry: RetryPolicy | None = MODEL_NODE_RETRY) -> StateGraph:
    g = StateGraph(AgentState, context_schema=Context, input_schema=AgentInput)
    g.add_node("prepare", prepare)
    g.add_node("plan", plan, destinations=("implement", "plan", "finalize"), retry_policy=model_retry)
    g.add_node(
        "implement", implement, destinations=("validate", "implement", "reflect"), retry_policy=model_retry
    )
    g.add_node("validate", validate)
    g.add_node("test", test)
    g.add_node("repair", repair, destinations=("validate", "reflect"), retry_policy=model_retry)
    g.add_node("on_failure", on_failure, destinations=("repair", "finalize"))
    g.add_node("autotune", autotune)
    g.add_node("profile", profile)
    g.add_node("reflect", reflect, retry_policy=model_retry)
    g.add_node("finalize", finalize)
    g.add_edge(START, "prepare")
    g.add_conditional_edges("prepare", route_after_prepare)
    g.add_conditional_edges("validate", route_after_validate)
    g.add_conditional_edges("test", route_after_test)
    g.add_edge("autotune", "profile")
    g.add_edge("profile", "reflect")
    g.add_conditional_edges("reflect", route_after_reflect)
    g.add_edge("finalize", END)
    return g


# The state's pydantic models, allowed by name in checkpoints (LangGraph refuses unknown types by default
# in future versions; naming them keeps resume working and everything else blocked).
STATE_TYPES: list[tuple[str, str]] = [
    ("maxkernel.tools.tasks", "KernelTask"),
    ("maxkernel.tools.results", "InputConfig"),
    ("maxkernel.tools.results", "ArraySpec"),
    ("maxkernel.tools.results", "EvalResult"),
    ("maxkernel.tools.results", "StageError"),
    ("maxkernel.tools.results", "PallasCheck"),
    ("maxkernel.tools.results", "CorrectnessResult"),
    ("maxkernel.tools.results", "SetCheck"),
    ("maxkernel.tools.results", "CompileOutcome"),
    ("maxkernel.tools.results", "MeasuredTiming"),
    ("maxkernel.tools.results", "EstimateSummary"),
    ("maxkernel.authors.base", "Plan"),
    ("maxkernel.authors.base", "TileConfig"),
    ("maxkernel.graph.state", "Budgets"),
    ("maxkernel.graph.state", "Usage"),
    ("maxkernel.graph.state", "Attempt"),
    ("maxkernel.graph.state", "HumanFeedback"),
    ("maxkernel.graph.state", "AgentState"),
    ("maxkernel.graph.search", "BranchTask"),
    ("maxkernel.graph.search", "SearchNode"),
    ("maxkernel.graph.search", "SearchInput"),
    ("maxkernel.graph.search", "SearchState"),
]


def serializer() -> Any:
    from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

    return JsonPlusSerializer(allowed_msgpack_modules=STATE_TYPES)


def sqlite_checkpointer(path: str | Path) -> Any:
    from langgraph.checkpoint.sqlite import SqliteSaver

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(path), check_same_thread=False, timeout=60)
    enable_wal(conn)
    return SqliteSaver(conn, serde=serializer())


def checkpointer_for(url_or_path: str) -> Any:
    """SqliteSaver for a path (default `checkpoints/maxkernel.sqlite`), PostgresSaver for a postgres URL."""
    if url_or_path.startswith(("postgres://", "postgresql://")):
        try:
            from langgraph.checkpoint.postgres import PostgresSaver
        except ImportError as exc:
            raise RuntimeError(
                "a Postgres checkpoint URL needs `pip install langgraph-checkpoint-postgres psycopg[binary]`"
            ) from exc
        import psycopg

        conn = psycopg.connect(url_or_path, autocommit=True)
        saver = PostgresSaver(conn, serde=serializer())
        saver.setup()
        return saver
    return sqlite_checkpointer(url_or_path)


def compile_graph(checkpointer: Any = None, model_retry: RetryPolicy | None = MODEL_NODE_RETRY) -> Any:
    return build_graph(model_retry).compile(checkpointer=checkpointer, name="maxkernel-agent")


# For `langgraph dev` / LangGraph Studio: the server supplies its own checkpointer.
graph = compile_graph()
