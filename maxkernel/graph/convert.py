"""The `convert` subgraph, mounted before `prepare`: a PyTorch, CUDA or Triton file becomes a JAX task.
This module only wires nodes (`maxkernel.nodes.convert`).

convert_source ──► (hitl) review_conversion ──► END
      ▲                       │ feedback (model-written references)
      └───────────────────────┘
A JAX task passes through untouched.
"""

from __future__ import annotations

from typing import Any

from langgraph.graph import END, START, StateGraph

from maxkernel.context import Context
from maxkernel.nodes.convert import (
    convert_source,
    review_conversion,
    route_after_convert_source,
    route_after_review,
)
from maxkernel.state import AgentState


def build_convert_graph() -> StateGraph:
    g = StateGraph(AgentState, context_schema=Context)
    g.add_node("convert_source", convert_source)
    g.add_node("review_conversion", review_conversion)
    g.add_edge(START, "convert_source")
    g.add_conditional_edges(
        "convert_source",
        route_after_convert_source,
        {"review_conversion": "review_conversion", "__end__": END},
    )
    g.add_conditional_edges(
        "review_conversion", route_after_review, {"convert_source": "convert_source", "__end__": END}
    )
    return g


def compile_convert_graph(checkpointer: Any = None) -> Any:
    """With no checkpointer it inherits the agent graph's when mounted there (checkpointed, resumable)."""
    return build_convert_graph().compile(checkpointer=checkpointer, name="maxkernel-convert")
