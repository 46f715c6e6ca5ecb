"""Search over optimisation strategies: parallel and beam, as LangGraph graphs. This module only wires
nodes (`maxkernel.nodes.search`); state is in `maxkernel.state`, the report in `maxkernel.search_report`.

Every branch is one run of the agent graph (compiled once and run as a subgraph inside the `branch` node)
with its own strategy, fanned out with `Send`: each branch is its own task, so branches run concurrently
(bounded by `max_concurrency` in the run config), a finished branch's result is checkpointed the moment it
completes, and a killed search resumes without re-running finished branches.

    parallel:  root ─Send→ N branches (distinct strategies) → select → finish (best of all)
    beam:      root → [expand ─Send→ W×B children → select (keep-factor gate, top W)] × depth → finish

Scores are measured speedups when a device measured them, estimated speedups otherwise, and every node
says which. Only kernels the harness accepted can win, so the reference is never the result.
"""

from __future__ import annotations

from typing import Any

from langgraph.graph import END, START, StateGraph

from maxkernel.context import Context
from maxkernel.nodes.search import branch, expand, finish, root, route_after_select, select
from maxkernel.state import BranchTask, SearchInput, SearchState


def build_search_graph() -> StateGraph:
    g = StateGraph(SearchState, context_schema=Context, input_schema=SearchInput)
    g.add_node("root", root, destinations=("branch",))
    g.add_node("branch", branch, input_schema=BranchTask)
    g.add_node("select", select)
    g.add_node("expand", expand, destinations=("branch",))
    g.add_node("finish", finish)
    g.add_edge(START, "root")
    g.add_edge("branch", "select")
    g.add_conditional_edges("select", route_after_select)
    g.add_edge("finish", END)
    return g


def compile_search(checkpointer: Any = None) -> Any:
    return build_search_graph().compile(checkpointer=checkpointer, name="maxkernel-search")


graph = compile_search()
