"""Search over optimisation strategies: parallel and beam, as LangGraph graphs.

Every branch is one run of the agent graph (mounted as a subgraph inside the `branch` node) with its own
strategy, fanned out with `Send`: each branch is its own task, so branches run concurrently (bounded by
`max_concurrency` in the run config), a finished branch's result is checkpointed the moment it completes,
and a killed search resumes without re-running finished branches.

    parallel:  root ─Send→ N branches (distinct strategies) → select → finish (best of all)
    beam:      root → [expand ─Send→ W×B children → select (keep-factor gate, top W)] × depth → finish

Scores are measured speedups when a device measured them, estimated speedups otherwise, and every node
says which. Only kernels the harness accepted can win, so the reference is never the result.
"""

from __future__ import annotations

import json
import operator
from pathlib import Path
from typing import Annotated, Any, Literal

from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime
from langgraph.types import Command, Send
from pydantic import BaseModel, Field

from maxkernel.graph.context import Context
from maxkernel.strategies import strategy_names

Algorithm = Literal["parallel", "beam"]


class SearchInput(BaseModel):
    task_path: str
    algorithm: Algorithm = "parallel"
    branches: int = Field(4, ge=1, description="parallel: branches; beam: children per expanded node")
    beam_width: int = Field(2, ge=1, description="beam: nodes kept per level")
    depth: int = Field(2, ge=1, description="beam: levels of expansion below the root")
    keep_factor: float = Field(1.0, gt=0, description="beam: a child survives if score >= factor x parent's")
    iterations: int = Field(1, ge=1, description="agent rounds per branch")
    tune_max_configs: int = Field(2, ge=0, description="autotune budget per branch round")
    strategies: list[str] | None = Field(None, description="strategies to draw from (default: the library)")
    scale: str | None = None
    out_dir: str | None = None


class SearchNode(BaseModel):
    id: str
    parent: str | None
    depth: int
    strategy: str | None
    accepted: bool = False
    source_path: str | None = None
    source_hash: str | None = None
    score_kind: Literal["measured", "estimated", "none"] = "none"
    score: float | None = Field(None, description="speedup of kind `score_kind` (measured or estimated)")
    kept: bool = False
    reason: str = ""
    result_path: str | None = None

    def rank(self) -> tuple[int, float]:
        kind = {"measured": 2, "estimated": 1, "none": 0}[self.score_kind]
        return (kind if self.accepted else -1, self.score or 0.0)


class BranchTask(BaseModel):
    """What `Send` hands one branch."""

    node_id: str
    parent: str | None
    depth: int
    strategy: str | None
    start_source_path: str | None = None
    search: SearchInput


class SearchState(SearchInput):
    nodes: Annotated[list[SearchNode], operator.add] = Field(default_factory=list)
    frontier: list[str] = Field(default_factory=list)
    level: int = 0
    best: SearchNode | None = None
    status: str = "running"
    result_path: str | None = None


def _settings(state: SearchState) -> SearchInput:
    return SearchInput.model_validate(state.model_dump(include=set(SearchInput.model_fields)))


def _strategy_pool(s: SearchInput, ctx: Context | None = None) -> list[str]:
    """The strategies branches draw from: the user's list, else what the author can apply (the offline
    author realises only some strategies; a branch with one it cannot apply would repeat the root)."""
    if s.strategies:
        return list(s.strategies)
    if ctx is not None and ctx.chat_model is None and ctx.model == "offline":
        from maxkernel.authors.offline.transforms import offline_strategies

        return offline_strategies()
    return strategy_names()


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


def branch(task: BranchTask, runtime: Runtime[Context]) -> dict[str, Any]:
    """One agent run as a subgraph (checkpointed under this task's namespace)."""
    from maxkernel.graph.agent import compile_graph

    task = BranchTask.model_validate(task)
    s = task.search
    out = Path(s.out_dir or Path("out") / Path(s.task_path).stem) / "branches" / task.node_id
    agent = compile_graph()  # no checkpointer of its own: it inherits the search's, namespaced per task
    final = agent.invoke(
        {
            "task_path": s.task_path,
            "mode": "auto",
            "max_iterations": s.iterations,
            "scale": s.scale,
            "out_dir": str(out),
            "strategy": task.strategy,
            "tune_max_configs": s.tune_max_configs,
            "start_source_path": task.start_source_path,
            "label": task.node_id,
        },
        context=runtime.context,
    )
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
        kind, value = best.score()
        node.accepted = True
        node.source_path, node.source_hash = best.source_path, best.source_hash
        node.score_kind = {2: "measured", 1: "estimated"}.get(kind, "none")  # type: ignore[assignment]
        node.score = value if kind else None
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
    (out / "report.md").write_text(_report(state, nodes, best, picture))
    return {
        "status": "succeeded" if best else "failed",
        "result_path": str(out / "result.json"),
        "best": best,
    }


def _report(
    state: SearchState, nodes: list[SearchNode], best: SearchNode | None, picture: Path | None
) -> str:
    lines = [f"# maxkernel search — {Path(state.task_path).name} ({state.algorithm})", ""]
    if best:
        lines.append(
            f"Best: node `{best.id}` (strategy {best.strategy or 'none'}), {best.score_kind} speedup "
            f"{best.score:.2f}x" + (" — **slower than XLA**" if best.score <= 1.0 else "")
            if best.score is not None
            else f"Best: node `{best.id}` (correct; no perf figure)"
        )
    else:
        lines.append("No branch produced a correct kernel.")
    lines += [
        "",
        "| node | parent | depth | strategy | correct | score | kind | kept | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n in sorted(nodes, key=lambda n: (n.depth, n.id)):
        score = f"{n.score:.2f}x" if n.score is not None else "—"
        lines.append(
            f"| {n.id} | {n.parent or '—'} | {n.depth} | {n.strategy or '—'} | {'yes' if n.accepted else 'no'} | "
            f"{score} | {n.score_kind} | {'yes' if n.kept else 'no'} | {n.reason[:80]} |"
        )
    if picture:
        lines += ["", f"![search tree]({picture.name})"]
    return "\n".join(lines) + "\n"


def render_tree_png(nodes: list[SearchNode], best_id: str | None, path: Path) -> Path | None:
    """The search tree as a picture: one row per depth, edges to parents, colour by verdict."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not nodes:
        return None
    levels: dict[int, list[SearchNode]] = {}
    for n in sorted(nodes, key=lambda n: n.id):
        levels.setdefault(n.depth, []).append(n)
    pos = {}
    for depth, row in levels.items():
        for i, n in enumerate(row):
            pos[n.id] = ((i + 1) / (len(row) + 1), -depth)
    width = max(6.0, 1.8 * max(len(r) for r in levels.values()))
    fig, ax = plt.subplots(figsize=(width, 1.8 * (len(levels) + 1)))
    for n in nodes:
        if n.parent and n.parent in pos:
            (x0, y0), (x1, y1) = pos[n.parent], pos[n.id]
            ax.plot([x0, x1], [y0, y1], color="#999999", zorder=1)
    for n in nodes:
        x, y = pos[n.id]
        colour = (
            "#2e7d32"
            if n.id == best_id
            else ("#81c784" if n.kept else ("#fff176" if n.accepted else "#e57373"))
        )
        ax.scatter([x], [y], s=900, color=colour, edgecolors="black", zorder=2)
        score = (
            f"{n.score:.2f}x {n.score_kind[:4]}" if n.score is not None else ("ok" if n.accepted else "fail")
        )
        ax.annotate(
            f"{n.id}\n{(n.strategy or 'root')[:18]}\n{score}",
            (x, y),
            ha="center",
            va="center",
            fontsize=7,
            zorder=3,
        )
    ax.set_axis_off()
    ax.set_title("search tree (green: best / kept, yellow: correct but pruned, red: failed)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


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
