"""The search graph's nodes: fan out branches, run one agent per branch, judge a level, write the result.

Each branch is one run of the agent graph, compiled once (`agent_subgraph`) and run as a subgraph inside the
`branch` node, so it inherits the search's checkpointer namespaced per `Send` task. Scores are measured
speedups when a device measured them, estimated speedups otherwise, never compared across kinds.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Literal

from langgraph.runtime import Runtime
from langgraph.types import Command, Send

from maxkernel.context import Context
from maxkernel.search_report import render_tree_png, search_report
from maxkernel.state import AgentInput, BranchTask, SearchInput, SearchNode, SearchState


def _settings(state: SearchState) -> SearchInput:
    return SearchInput.model_validate(state.model_dump(include=set(SearchInput.model_fields)))


def _strategy_pool(state: SearchState, ctx: Context | None = None) -> list[str]:
    """The strategies branches draw from: the user's list, else what the author can apply (the offline
    author realises only some strategies; a branch with one it cannot apply would repeat the root)."""
    if state.strategies:
        return list(state.strategies)
    if ctx is not None and ctx.is_offline:
        from maxkernel.authors.offline.transforms import offline_strategies

        return offline_strategies()
    return state.strategy_pool()


def root(state: SearchState, runtime: Runtime[Context]) -> Command[Literal["branch"]]:
    if state.algorithm == "parallel":
        pool = _strategy_pool(state, runtime.context)
        sends = [
            Send(
                "branch",
                BranchTask(
                    node_id=f"p{i}",
                    parent=None,
                    depth=1,
                    strategy=pool[i % len(pool)],
                    search=_settings(state),
                ),
            )
            for i in range(state.branches)
        ]
        return Command(goto=sends)
    return Command(
        goto=[
            Send(
                "branch",
                BranchTask(node_id="root", parent=None, depth=0, strategy=None, search=_settings(state)),
            )
        ]
    )


_AGENT_LOCK = threading.Lock()
_AGENT: list[Any] = []


def agent_subgraph() -> Any:
    """The agent graph every branch runs, compiled once per process (under a lock: branches start
    concurrently). No checkpointer of its own: run inside a node it inherits the search's, namespaced per
    `Send` task. Compiled graphs hold no run state, so concurrent branches share it safely."""
    with _AGENT_LOCK:
        if not _AGENT:
            from maxkernel.graph.agent import compile_graph

            _AGENT.append(compile_graph())
        return _AGENT[0]


def reset_agent_subgraph() -> None:
    """Drop the compiled agent graph (the next branch compiles it again): for code that rebuilds the graph
    module, and tests that count compiles."""
    with _AGENT_LOCK:
        _AGENT.clear()


def branch(task: BranchTask, runtime: Runtime[Context]) -> dict[str, Any]:
    """One agent run as a subgraph (checkpointed under this task's namespace)."""
    task = BranchTask.model_validate(task)
    s = task.search
    out = Path(s.out_dir or Path("out") / Path(s.task_path).stem) / "branches" / task.node_id
    branch_input = AgentInput(
        task_path=s.task_path,
        mode="auto",
        max_iterations=s.iterations,
        scale=s.scale,
        out_dir=str(out),
        strategy=task.strategy,
        tune_max_configs=s.tune_max_configs,
        start_source_path=task.start_source_path,
        label=task.node_id,
    )
    final = agent_subgraph().invoke(branch_input.model_dump(), context=runtime.context)
    best = final.get("best")
    node = SearchNode(
        id=task.node_id,
        parent=task.parent,
        depth=task.depth,
        strategy=task.strategy,
        result_path=final.get("result_path"),
        reason=final.get("stop_reason") or "",
    )
    if best is not None and best.accepted:
        node.accepted = True
        node.source_path, node.source_hash = best.source_path, best.source_hash
        node.score_kind = best.score_kind()
        node.score = best.score()[1] if node.score_kind != "none" else None
        node.score_text = best.score_text()
    return {"nodes": [node]}


def select(state: SearchState) -> dict[str, Any]:
    """Judge the level that just finished: the keep-factor gate against each parent, then the top W."""
    nodes = latest_nodes(state.nodes)
    by_id = {n.id: n for n in nodes}
    depth = state.level + (1 if state.algorithm == "parallel" else 0)
    judged = []
    for n in (n.model_copy() for n in nodes if n.depth == depth):
        parent = by_id.get(n.parent) if n.parent else None
        if not n.accepted:
            n.reason = n.reason or "no correct kernel"
        elif parent is not None and parent.accepted and not _beats(n, parent, state.keep_factor):
            n.reason = f"not faster than its parent by x{state.keep_factor:g} ({n.score} vs {parent.score})"
        else:
            n.kept = True
        judged.append(n)
    survivors = sorted((n for n in judged if n.kept), key=lambda n: n.rank(), reverse=True)
    everything = latest_nodes(nodes + judged)
    accepted = [n for n in everything if n.accepted]
    return {
        "nodes": judged,
        "frontier": [n.id for n in survivors[: state.beam_width]],
        "best": max(accepted, key=lambda n: n.rank()) if accepted else None,
        "level": state.level + 1,
    }


def _beats(child: SearchNode, parent: SearchNode, factor: float) -> bool:
    """Correct and faster than the parent by the factor, on the same kind of figure (never measured vs
    estimated), and not merely the parent's own kernel again."""
    if child.source_hash == parent.source_hash or child.score_kind != parent.score_kind:
        return False
    if child.score is None or parent.score is None:
        return False
    return child.score >= parent.score * factor


def latest_nodes(nodes: list[SearchNode]) -> list[SearchNode]:
    """The reducer appends; a node re-emitted with its verdict supersedes the earlier record of it."""
    seen: dict[str, SearchNode] = {}
    for n in nodes:
        seen[n.id] = n
    return list(seen.values())


def route_after_select(state: SearchState) -> Literal["expand", "finish"]:
    if state.algorithm == "beam" and state.level <= state.depth and state.frontier:
        return "expand"
    return "finish"


def expand(state: SearchState, runtime: Runtime[Context]) -> Command[Literal["branch"]]:
    nodes = {n.id: n for n in latest_nodes(state.nodes)}
    pool = _strategy_pool(state, runtime.context)
    sends = []
    for p_index, pid in enumerate(state.frontier):
        parent = nodes[pid]
        used = _path_strategies(parent, nodes)
        fresh = [s for s in pool if s not in used] or pool
        for k in range(state.branches):
            sends.append(
                Send(
                    "branch",
                    BranchTask(
                        node_id=f"d{state.level}-{p_index}-{k}",
                        parent=parent.id,
                        depth=state.level,
                        strategy=fresh[(p_index * state.branches + k) % len(fresh)],
                        start_source_path=parent.source_path,
                        search=_settings(state),
                    ),
                )
            )
    return Command(goto=sends)


def _path_strategies(node: SearchNode, nodes: dict[str, SearchNode]) -> set[str]:
    used: set[str] = set()
    cur: SearchNode | None = node
    while cur is not None:
        if cur.strategy:
            used.add(cur.strategy)
        cur = nodes.get(cur.parent) if cur.parent else None
    return used


def finish(state: SearchState) -> dict[str, Any]:
    nodes = latest_nodes(state.nodes)
    out = Path(state.out_dir or Path("out") / Path(state.task_path).stem)
    out.mkdir(parents=True, exist_ok=True)
    accepted = [n for n in nodes if n.accepted]
    best = max(accepted, key=lambda n: n.rank()) if accepted else None
    tree = {
        "algorithm": state.algorithm,
        "settings": _settings(state).model_dump(mode="json"),
        "nodes": [n.model_dump(mode="json") for n in nodes],
        "best": best.id if best else None,
    }
    (out / "search_tree.json").write_text(json.dumps(tree, indent=2))
    picture = render_tree_png(nodes, best.id if best else None, out / "search_tree.png")
    kernel_path = None
    if best is not None and best.source_path:
        kernel_path = out / "kernel.py"
        kernel_path.write_text(Path(best.source_path).read_text())
    result = {
        "task_id": Path(state.task_path).name,
        "algorithm": state.algorithm,
        "correct": best is not None,
        "kernel_path": str(kernel_path) if kernel_path else None,
        "best_node": best.model_dump(mode="json") if best else None,
        "score_kind": best.score_kind if best else None,
        "nodes": len(nodes),
        "accepted_nodes": len(accepted),
    }
    if best and best.result_path and Path(best.result_path).exists():
        branch_result = json.loads(Path(best.result_path).read_text())
        result["harness"] = branch_result.get("harness")
        result["verdict"] = branch_result.get("verdict")  # the best branch's own faster/slower verdict
    if not result.get("verdict"):
        result["verdict"] = {
            "outcome": "no result",
            "line": "no accepted kernel: nothing to compare with XLA",
        }
    (out / "result.json").write_text(json.dumps(result, indent=2))
    (out / "report.md").write_text(search_report(state, nodes, best, picture))
    return {
        "status": "succeeded" if best else "failed",
        "result_path": str(out / "result.json"),
        "best": best,
    }
