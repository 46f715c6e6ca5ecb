"""The search's report: a markdown table of every branch and a picture of the tree.

Written by the search's `finish` node (`maxkernel.nodes.search`) next to `search_tree.json` and the winning
kernel; the agent's own per-run report is written by `maxkernel.nodes.finalize`.
"""

from __future__ import annotations

from pathlib import Path

from maxkernel.state import SearchNode, SearchState


def search_report(
    state: SearchState, nodes: list[SearchNode], best: SearchNode | None, picture: Path | None
) -> str:
    lines = [f"# maxkernel search — {Path(state.task_path).name} ({state.algorithm})", ""]
    if best:
        lines.append(
            f"Best: node `{best.id}` (strategy {best.strategy or 'none'}), speedup "
            f"{best.score_text or f'{best.score_kind} {best.score:.2f}x'}"
            + (" — **slower than XLA**" if best.score <= 1.0 else "")
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
