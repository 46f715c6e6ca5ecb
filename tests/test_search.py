"""Parallel and beam search with a scripted (prompt-routed) chat model: results, pruning, the tree
picture, and kill + resume without re-running finished branches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fake_chat import Killed, RoutedChatModel
from maxkernel.checkpointing import sqlite_checkpointer
from maxkernel.context import Context
from maxkernel.graph.search import compile_search
from maxkernel.nodes.search import latest_nodes
from maxkernel.tools.store import ResultsStore

DATA = Path(__file__).parent / "data"
TASK = DATA / "tasks" / "small_matmul"
CODE = "```python\n" + (DATA / "candidates" / "llm_correct.py").read_text() + "```\n"
STRATEGIES = ["larger_tiles", "smaller_tiles"]


def routed(**kw: object) -> RoutedChatModel:
    return RoutedChatModel(
        rules=[
            ("— reflect", json.dumps({"decision": "stop", "reason": "done"})),
            ("Write a plan", "# Plan\nTiled matmul, fused epilogue."),
            ("Write the complete kernel", CODE),
            ("— repair", CODE),
        ],
        **kw,
    )


def setup(tmp_path: Path, model: RoutedChatModel):
    graph = compile_search(sqlite_checkpointer(tmp_path / "checkpoints.sqlite"))
    ctx = Context(
        model="routed",
        chat_model=model,
        tpu=["v5e"],
        store_path=str(tmp_path / "results.db"),
        work_dir=str(tmp_path / "work"),
        baseline=False,
    )
    return graph, ctx


def inputs(tmp_path: Path, algorithm: str, **kw: object) -> dict:
    return {
        "task_path": str(TASK),
        "algorithm": algorithm,
        "branches": 2,
        "depth": 1,
        "beam_width": 1,
        "tune_max_configs": 1,
        "strategies": STRATEGIES,
        "out_dir": str(tmp_path / "out"),
        **kw,
    }


def check_outputs(out: Path) -> dict:
    result = json.loads((out / "result.json").read_text())
    assert result["correct"] and result["kernel_path"]
    kernel = Path(result["kernel_path"]).read_text()
    reference = (TASK / "reference.py").read_text()
    assert kernel != reference and "pallas_call" in kernel  # never the reference
    assert result["harness"]["accepted"] and result["score_kind"] == "estimated"
    tree = json.loads((out / "search_tree.json").read_text())
    assert tree["best"] == result["best_node"]["id"]
    png = (out / "search_tree.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "![search tree](search_tree.png)" in (out / "report.md").read_text()
    return tree


def test_parallel_search(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import maxkernel.graph.agent
    from maxkernel.nodes.search import reset_agent_subgraph

    builds = []
    build_graph = maxkernel.graph.agent.build_graph
    monkeypatch.setattr(
        maxkernel.graph.agent, "build_graph", lambda *a, **k: builds.append(1) or build_graph(*a, **k)
    )
    reset_agent_subgraph()
    model = routed()
    graph, ctx = setup(tmp_path, model)
    config = {"configurable": {"thread_id": "par"}, "max_concurrency": 2}
    final = graph.invoke(inputs(tmp_path, "parallel"), config, context=ctx)
    reset_agent_subgraph()  # later tests build their own, unpatched
    nodes = latest_nodes(final["nodes"])
    assert sorted(n.strategy for n in nodes) == sorted(STRATEGIES)
    assert all(n.accepted for n in nodes)
    assert len(builds) == 1  # both branches ran the one compiled agent subgraph
    # concurrent branches each charge exactly their own model calls (no shared usage counter)
    per_branch = [json.loads(Path(n.result_path).read_text())["model_calls"] for n in nodes]
    assert sum(per_branch) == model.calls and all(c > 0 for c in per_branch)
    tree = check_outputs(tmp_path / "out")
    assert len(tree["nodes"]) == 2
    # each branch's plan prompt carried its own strategy's text
    assert any("Grow the tiles" in p for p in model.prompts)
    assert any("Shrink the tiles" in p for p in model.prompts)


def test_beam_search_prunes_children_that_do_not_beat_their_parent(tmp_path: Path) -> None:
    graph, ctx = setup(tmp_path, routed())
    final = graph.invoke(
        inputs(tmp_path, "beam", keep_factor=10.0), {"configurable": {"thread_id": "beam"}}, context=ctx
    )
    nodes = {n.id: n for n in latest_nodes(final["nodes"])}
    assert nodes["root"].kept and nodes["root"].depth == 0
    children = [n for n in nodes.values() if n.parent == "root"]
    assert len(children) == 2 and all(not c.kept for c in children)
    assert all("not faster than its parent" in c.reason for c in children)
    # pruning stops expansion; the result is still the best correct kernel seen anywhere in the tree
    assert final["best"].rank() == max(n.rank() for n in nodes.values())
    check_outputs(tmp_path / "out")


def test_killed_search_resumes_without_rerunning_finished_branches(tmp_path: Path) -> None:
    model = routed(kill_once_on="Shrink the tiles")
    graph, ctx = setup(tmp_path, model)
    config = {"configurable": {"thread_id": "killed"}, "max_concurrency": 1}
    with pytest.raises(Killed):
        graph.invoke(inputs(tmp_path, "parallel"), config, context=ctx)
    grow_plans = sum("Grow the tiles" in p for p in model.prompts)
    assert grow_plans == 1  # the larger_tiles branch finished before the kill
    final = graph.invoke(None, config, context=ctx)
    assert sum("Grow the tiles" in p for p in model.prompts) == grow_plans  # not re-run
    assert sum("Shrink the tiles" in p for p in model.prompts) == 1
    assert {n.strategy for n in latest_nodes(final["nodes"])} == set(STRATEGIES)
    store = ResultsStore(tmp_path / "results.db")
    assert len(store.executions()) == len(set(store.executions()))
    check_outputs(tmp_path / "out")


def _offline_search(tmp_path: Path, algorithm: str) -> dict:
    graph = compile_search(sqlite_checkpointer(tmp_path / "checkpoints.sqlite"))
    ctx = Context(
        model="offline", tpu=["v5e"], store_path=str(tmp_path / "results.db"), work_dir=str(tmp_path / "w")
    )
    return graph.invoke(
        inputs(tmp_path / algorithm, algorithm, tune_max_configs=2),
        {"configurable": {"thread_id": f"offline-{algorithm}"}},
        context=ctx,
    )


def test_offline_author_searches_in_parallel(tmp_path: Path) -> None:
    """The offline author maps strategies to concrete variants (the strategy's preferred tile config)."""
    final = _offline_search(tmp_path, "parallel")
    nodes = latest_nodes(final["nodes"])
    assert all(n.accepted and n.score_kind == "estimated" for n in nodes)
    check_outputs(tmp_path / "parallel" / "out")


# A second whole offline search (76 s alone at a load of 10 on 2 cores) runs with `-m slow`; the default run
# keeps beam search's pruning and expansion with the scripted model
# (test_beam_search_prunes_children_that_do_not_beat_their_parent) and the offline author's strategy variants
# in a search (test_offline_author_searches_in_parallel).
@pytest.mark.slow
def test_offline_author_beam_search(tmp_path: Path) -> None:
    final = _offline_search(tmp_path, "beam")
    tree = check_outputs(tmp_path / "beam" / "out")
    assert {n["depth"] for n in tree["nodes"]} == {0, 1}
    assert final["best"].accepted
