"""The whole graph driven by a scripted chat model whose replies are real Pallas code.

Proves the repair loop (a kernel Mosaic rejects, then a wrong one, then a correct one), that test feedback
reaches the author, that the stop rules end the run, and that the outputs are written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fake_chat import ScriptedChatModel
from maxkernel.checkpointing import sqlite_checkpointer
from maxkernel.context import Context
from maxkernel.graph.agent import compile_graph
from maxkernel.tools.store import ResultsStore

CANDIDATES = Path(__file__).parent / "data" / "candidates"
TASK = Path(__file__).parent / "data" / "tasks" / "small_matmul"


def fenced(name: str) -> str:
    return "Here is the kernel.\n```python\n" + (CANDIDATES / name).read_text() + "```\n"


def stop_reply(reason: str = "good enough") -> str:
    return json.dumps({"decision": "stop", "reason": reason, "next_strategy": None, "hint": None})


def run_graph(tmp_path: Path, model: ScriptedChatModel, **inputs: object) -> dict:
    graph = compile_graph(sqlite_checkpointer(tmp_path / "checkpoints.sqlite"))
    ctx = Context(
        model="scripted",
        chat_model=model,
        tpu=["v5e"],
        store_path=str(tmp_path / "results.db"),
        work_dir=str(tmp_path / "work"),
        baseline=False,
    )
    config = {"configurable": {"thread_id": "scripted-1"}}
    graph.invoke({"task_path": str(TASK), "out_dir": str(tmp_path / "out"), **inputs}, config, context=ctx)
    return graph.get_state(config).values


def test_repair_loop_and_test_feedback(tmp_path: Path) -> None:
    model = ScriptedChatModel(
        replies=[
            "# Plan\nA tiled matmul, bias and relu fused into the epilogue.",
            fenced("llm_whole_array.py"),  # compiles in interpret mode, overflows VMEM at production shapes
            fenced("llm_wrong_no_bias.py"),  # compiles, but forgets the bias
            fenced("llm_correct.py"),
            stop_reply(),
        ]
    )
    state = run_graph(tmp_path, model, max_iterations=3, tune_max_configs=1)

    kinds = [(a.kind, a.stage) for a in state["attempts"]]
    assert kinds[:3] == [("implement", "compile"), ("repair", "correctness"), ("repair", "accepted")]
    assert (
        "CompileTimeScopedVmemOom" in state["attempts"][0].message
        or "vmem" in state["attempts"][0].message.lower()
    )
    # The repair prompts carried the harness's words: the Mosaic error, then the wrong values.
    repair_prompts = [m[-1].content for m in model.prompts[2:4]]
    assert "Stage: compile" in repair_prompts[0] and "vmem" in repair_prompts[0].lower()
    assert "Stage: correctness" in repair_prompts[1] and "outside atol" in repair_prompts[1]
    assert state["best"].kind in ("repair", "tune") and state["best"].accepted
    assert state["status"] == "succeeded"
    assert state["stop_reason"] == "author: good enough"
    assert state["usage"].model_calls == 5

    out = tmp_path / "out"
    result = json.loads((out / "result.json").read_text())
    assert result["correct"] and result["accepted"] and result["thread_id"] == "scripted-1"
    assert result["iterations"] == 1 and result["harness"]["tpu_compile"]["v5e"]["ok"]
    assert (out / "kernel.py").read_text() == Path(state["best"].source_path).read_text()
    report = (out / "report.md").read_text()
    assert "## Errors met" in report and "CompileTimeScopedVmemOom" in report
    assert "estimated speedup" in report and "measured: nothing" in report


def test_stop_rule_iteration_budget_and_hint(tmp_path: Path) -> None:
    hint = json.dumps(
        {
            "decision": "continue",
            "reason": "try bigger tiles",
            "next_strategy": "larger_tiles",
            "hint": "grow BLOCK_N",
        }
    )
    model = ScriptedChatModel(
        replies=[
            "# Plan one",
            fenced("llm_correct.py"),
            hint,
            "# Plan two",
            fenced("llm_correct.py"),
        ]
    )
    state = run_graph(tmp_path, model, max_iterations=2, tune_max_configs=0)
    assert state["iteration"] == 2
    assert state["stop_reason"] == "iteration budget spent (2/2)"
    # round two's plan prompt carried the reflection's hint
    assert "grow BLOCK_N" in model.prompts[3][-1].content
    # the same kernel twice is one evaluation: the store served the second
    store = ResultsStore(tmp_path / "results.db")
    assert len(store.executions()) == len(set(store.executions()))


def test_patience_stops_a_run_without_gain(tmp_path: Path) -> None:
    again = json.dumps({"decision": "continue", "reason": "", "hint": "again"})
    code = fenced("llm_correct.py")
    model = ScriptedChatModel(replies=["# Plan", code, again, "# Plan", code, again, "# Plan", code])
    state = run_graph(tmp_path, model, max_iterations=5, tune_max_configs=0)
    # round 1 gains (first correct kernel); rounds 2 and 3 bring the same kernel: no gain twice = patience
    assert state["iteration"] == 3
    assert state["stop_reason"] == "no improvement for 2 round(s)"
    assert model.position == len(model.replies)


@pytest.mark.parametrize("bad", ["no code here", "```python\nprint('no entry point')\n```"])
def test_unusable_replies_are_evaluated_or_reported(tmp_path: Path, bad: str) -> None:
    model = ScriptedChatModel(replies=["# Plan", bad, stop_reply()])
    state = run_graph(tmp_path, model, max_iterations=1, tune_max_configs=0)
    assert state.get("best") is None and state["status"] == "failed"
    assert not (tmp_path / "out" / "kernel.py").exists()
    assert json.loads((tmp_path / "out" / "result.json").read_text())["correct"] is False


def test_reflect_picks_the_next_strategy_from_the_bound(tmp_path: Path) -> None:
    again = json.dumps({"decision": "continue", "reason": "", "hint": ""})
    code = fenced("llm_correct.py")
    model = ScriptedChatModel(replies=["# Plan", code, again, "# Plan", code])
    state = run_graph(tmp_path, model, max_iterations=2, tune_max_configs=0)
    bound = state["best"].estimated_bound
    assert bound in ("memory", "compute", "overhead")
    from maxkernel.nodes.reflect import BOUND_STRATEGIES

    assert state["strategy"] == BOUND_STRATEGIES[bound][0]
    # round two's plan prompt carried the chosen strategy's text
    from maxkernel.strategies import get_strategy

    assert get_strategy(state["strategy"]).title in model.prompts[3][-1].content
