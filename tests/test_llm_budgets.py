"""Budgets are promises: the model-call, token and wall-time budgets are checked before every model call
(the plan, the kernel, a re-ask of a bad reply, a retry of a failed call), and a spent one stops the run
with that budget named as the reason. None of these runs evaluates a kernel, so they are fast."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage

from fake_chat import KERNEL, EventChatModel, StallingChatModel, gemini3_message, gemini_429
from maxkernel.authors import usage_ledger
from maxkernel.checkpointing import sqlite_checkpointer
from maxkernel.context import Context
from maxkernel.graph.agent import compile_graph
from maxkernel.nodes.common import store_at

TASK = Path(__file__).parent / "data" / "tasks" / "small_matmul"
PLAN = "# Plan\nTiled matmul, bias and relu fused into the epilogue."
CODE = "```python\n" + KERNEL + "```"


def run(tmp_path: Path, model: Any, **budgets: Any) -> dict[str, Any]:
    ctx = Context(
        model="fake:events", chat_model=model, tpu=["v5e"], store_path=str(tmp_path / "results.db"),
        work_dir=str(tmp_path / "work"), baseline=False, model_retries=2, backoff_initial_s=0.001,
        backoff_max_s=0.01, **budgets,
    )  # fmt: skip
    graph = compile_graph(sqlite_checkpointer(tmp_path / "ck.sqlite"))
    config = {"configurable": {"thread_id": "budget"}}
    graph.invoke(
        {"task_path": str(TASK), "out_dir": str(tmp_path / "out"), "max_iterations": 3}, config, context=ctx
    )
    return graph.get_state(config).values


def result(tmp_path: Path) -> dict[str, Any]:
    return json.loads((tmp_path / "out" / "result.json").read_text())


@pytest.mark.parametrize(
    ("events", "budget", "calls"),
    [
        ([PLAN, CODE], 1, 1),  # the kernel call is not made: the plan spent the one call
        ([PLAN, "I would tile it by 128.", CODE], 2, 2),  # the re-ask of a code-less reply is not made
        ([PLAN, gemini_429("0.001s"), CODE], 2, 2),  # the retry of the 429 is not made
        ([gemini_429("0.001s"), gemini_429("0.001s"), PLAN], 2, 2),  # nor the plan's third attempt
    ],
    ids=["before-implement", "before-a-re-ask", "before-a-retry", "within-the-plan-retries"],
)
def test_the_model_call_budget_holds_at_every_call(
    tmp_path: Path, events: list[Any], budget: int, calls: int
) -> None:
    model = EventChatModel(events=events)
    values = run(tmp_path, model, max_model_calls=budget)
    assert model.calls == calls
    assert values["stop_reason"] == f"model-call budget spent ({calls}/{budget})"
    assert values["usage"].model_calls == calls and result(tmp_path)["model_calls"] == calls
    assert values["status"] == "failed" and result(tmp_path)["stop_reason"] == values["stop_reason"]


def _reporting(text: str, tokens: int) -> AIMessage:
    message = gemini3_message(text)
    message.usage_metadata = {"input_tokens": tokens - 100, "output_tokens": 100, "total_tokens": tokens}
    return message


@pytest.mark.parametrize(
    ("plan_tokens", "reason"),
    [(25_000, "token budget spent (25000/20000)"), (19_000, "token budget: the next call's prompt (~")],
    ids=["spent", "next-prompt-does-not-fit"],
)
def test_the_token_budget_holds_at_every_call(tmp_path: Path, plan_tokens: int, reason: str) -> None:
    model = EventChatModel(events=[_reporting(PLAN, plan_tokens), CODE])
    values = run(tmp_path, model, max_tokens=20_000)
    assert model.calls == 1 and values["usage"].tokens == plan_tokens
    assert values["stop_reason"].startswith(reason)
    if plan_tokens < 20_000:
        assert "does not fit in the 1000 left (19000/20000 spent)" in values["stop_reason"]


def test_a_prompt_larger_than_the_whole_token_budget_is_never_sent(tmp_path: Path) -> None:
    model = EventChatModel(events=[PLAN, CODE])
    values = run(tmp_path, model, max_tokens=500)
    assert model.calls == 0 and values["usage"].tokens == 0
    assert values["stop_reason"].startswith("token budget: the next call's prompt")


def test_the_wall_time_budget_cancels_a_call_at_the_deadline(tmp_path: Path) -> None:
    model = StallingChatModel(stalls=5, stall_s=60.0)
    values = run(tmp_path, model, max_wall_s=4.0)
    ended = time.time()
    assert values["stop_reason"] == "wall-time budget spent (4 s)"
    # The plan call (made if preparing the task left time) was cancelled at the deadline, not left running.
    assert model.events() in ([], ["start", "cancelled"])
    assert (
        ended - values["usage"].started_at < 4.0 + 3.0
    )  # the deadline, plus finalize and the graph's own work
    ledger = usage_ledger.totals(store_at(str(tmp_path / "results.db")), "budget/")
    assert (
        values["usage"].model_calls
        == len([e for e in model.events() if e == "start"])
        == (ledger or (0, 0))[0]
    )


def test_no_budget_no_change(tmp_path: Path) -> None:
    """Budgets that are not reached change nothing: the run goes on to validate (interrupted there)."""
    model = EventChatModel(events=[PLAN, CODE])
    ctx = Context(
        model="fake:events", chat_model=model, tpu=["v5e"], store_path=str(tmp_path / "results.db"),
        work_dir=str(tmp_path / "work"), baseline=False, max_model_calls=2, max_tokens=1_000_000,
    )  # fmt: skip
    saver = sqlite_checkpointer(tmp_path / "ck.sqlite")
    from maxkernel.graph.agent import build_graph

    graph = build_graph().compile(checkpointer=saver, interrupt_before=["validate"])
    config = {"configurable": {"thread_id": "t"}}
    graph.invoke({"task_path": str(TASK), "max_iterations": 1}, config, context=ctx)
    state = graph.get_state(config)
    assert state.next == ("validate",) and state.values.get("stop_reason") is None and model.calls == 2
