"""Model failures end as named, resumable states; never as "succeeded" with someone else's kernel.

The graph-level tests fail at the plan step, before any kernel is evaluated (fast). The CLI test goes the
whole way: a 429 storm ends `optimize` with exit 4 and status `rate_limited`, `runs` shows it, and
`resume` finishes once the provider answers (one harness evaluation)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import maxkernel.authors.llm as llm_module
from fake_chat import KERNEL, EventChatModel, ProviderError, gemini_429
from maxkernel.authors import usage_ledger
from maxkernel.authors.model_calls import ModelCallError
from maxkernel.checkpointing import sqlite_checkpointer
from maxkernel.context import Context
from maxkernel.graph.agent import compile_graph
from maxkernel.nodes.common import store_at
from provider_errors import anthropic_overloaded, gemini_error, openai_timeout

TASK = Path(__file__).parent / "data" / "tasks" / "small_matmul"
STOP = '{"decision": "stop", "reason": "good enough"}'


def fast_context(tmp_path: Path, model: Any, **kw: Any) -> Context:
    return Context(
        model="fake:events",
        chat_model=model,
        tpu=["v5e"],
        store_path=str(tmp_path / "results.db"),
        work_dir=str(tmp_path / "work"),
        baseline=False,
        **{"model_retries": 2, "backoff_initial_s": 0.001, "backoff_max_s": 0.01, **kw},
    )


@pytest.mark.parametrize(
    ("failure", "kind", "calls"),
    [
        (gemini_429("0.01s"), "rate_limited", 3),  # retried: 1 call + 2 retries
        (TimeoutError("read timed out"), "model_timeout", 3),
        (ConnectionError("Connection refused"), "model_unavailable", 3),
        (ProviderError(400, "API key not valid. Please pass a valid API key."), "model_auth", 1),
        (ProviderError(404, "models/gemini-9-pro is not found for API version v1beta"), "model_not_found", 1),
    ],
)
def test_a_failed_model_ends_the_run_resumably(
    tmp_path: Path, failure: Exception, kind: str, calls: int
) -> None:
    model = EventChatModel(events=[failure] * 3)
    graph = compile_graph(sqlite_checkpointer(tmp_path / "ck.sqlite"))
    config = {"configurable": {"thread_id": "t"}}
    with pytest.raises(ModelCallError) as err:
        graph.invoke(
            {"task_path": str(TASK), "out_dir": str(tmp_path / "out")},
            config,
            context=fast_context(tmp_path, model),
        )
    assert err.value.kind == kind and model.calls == calls
    snap = graph.get_state(config)
    assert snap.next == ("plan",)  # resumable at the step that failed
    assert (
        snap.values.get("status", "running") == "running" and not (tmp_path / "out" / "result.json").exists()
    )


@pytest.mark.parametrize("retries", [0, 2])
@pytest.mark.parametrize(
    "failure",
    [anthropic_overloaded(), gemini_error(429, "Quota exceeded.", retry_delay="0.001s"), openai_timeout()],
    ids=["anthropic-529", "gemini-429", "openai-timeout"],
)
def test_one_layer_retries_a_storm_exactly_as_asked(
    tmp_path: Path, failure: BaseException, retries: int
) -> None:
    """No node-level retry on top of the call-level one: --model-retries N means N + 1 requests, and the
    error counts exactly those."""
    graph = compile_graph(sqlite_checkpointer(tmp_path / "ck.sqlite"))
    assert all(spec.retry_policy is None for spec in graph.builder.nodes.values())
    model = EventChatModel(events=[failure] * 12)
    config = {"configurable": {"thread_id": "t"}}
    with pytest.raises(ModelCallError) as err:
        graph.invoke(
            {"task_path": str(TASK)}, config, context=fast_context(tmp_path, model, model_retries=retries)
        )
    assert model.calls == retries + 1 and err.value.attempts == retries + 1
    assert graph.get_state(config).values["usage"].model_calls == 0  # the failed step wrote no state...
    assert usage_ledger.totals(store_at(str(tmp_path / "results.db")), "t/") == (
        retries + 1,
        0,
    )  # ...the ledger did


@pytest.mark.slow  # two harness evaluations (baseline + the model's kernel): ~2 min on 2 shared cores
def test_cli_rate_limited_run_exits_4_and_resumes_once_the_model_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from maxkernel.cli import app

    # 1 call + 3 retries, and nothing retries the step on top of them: 4 answers of 429
    model = EventChatModel(events=[gemini_429("0.01s")] * 4)
    monkeypatch.setattr(llm_module, "init_model", lambda spec, settings=None: model)
    files = ["--checkpoint-db", str(tmp_path / "ck.sqlite"), "--store", str(tmp_path / "store.db")]
    runner = CliRunner()
    first = runner.invoke(
        app,
        ["optimize", str(TASK), "--model", "fake:events", "--iterations", "1", "--tpu", "v5e",
         "--tune-configs", "0", "--out", str(tmp_path / "out"), "--thread-id", "flaky-1",
         "--work-dir", str(tmp_path / "work"), "--model-retries", "3", *files],
    )  # fmt: skip
    assert first.exit_code == 4, first.output
    assert (
        model.calls == 4
        and "after 4 attempt(s)" in first.output
        and "rate_limited" in first.output
        and "maxkernel resume flaky-1" in first.output
    )
    assert "succeeded" not in first.output and not (tmp_path / "out" / "result.json").exists()
    runs = runner.invoke(app, ["runs", "--store", str(tmp_path / "store.db"), "--json"])
    row = json.loads(runs.output.strip().splitlines()[-1])
    assert row["status"] == "rate_limited" and json.loads(row["settings"])["limits"]["model_retries"] == 3
    # The offline baseline was evaluated in prepare, but it is reported as the baseline only.
    assert "offline baseline" in first.output and "not a result of the model" in first.output

    model.events = [
        "# Plan\nTiled matmul, bias and relu fused into the epilogue.",
        "```python\n" + KERNEL + "```",
    ]
    second = runner.invoke(app, ["resume", "flaky-1", "--store", str(tmp_path / "store.db")])
    assert second.exit_code == 0, second.output
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["status"] == "succeeded" and result["correct"]
    assert result["model_calls"] == 6  # 4 rate-limited calls (same process: carried over) + 2 answered
    assert result["tokens"] == model.reported_tokens


def test_resumed_run_finishes_and_counts_the_failed_calls_too(tmp_path: Path) -> None:
    model = EventChatModel(events=[gemini_429("0.01s")] * 3)
    graph = compile_graph(sqlite_checkpointer(tmp_path / "ck.sqlite"))
    config = {"configurable": {"thread_id": "t"}}
    ctx = fast_context(tmp_path, model)
    inp = {"task_path": str(TASK), "out_dir": str(tmp_path / "out"), "max_iterations": 1}
    with pytest.raises(ModelCallError):
        graph.invoke(inp, config, context=ctx)
    # The provider is back: a plan, then two replies without code (the step gives up; no evaluation needed).
    model.events = ["# Plan\nTiled matmul.", "I would tile it by 128.", "Still thinking about it."]
    graph.invoke(None, config, context=ctx)
    values = graph.get_state(config).values
    assert (
        values["plan"].summary == "Plan"
        and "implement: the model's reply was unusable twice" in values["errors"][0]
    )
    assert values["status"] == "failed" and values["stop_reason"].startswith("iteration budget spent")
    usage = values["usage"]
    assert model.calls == 6 and usage.model_calls == 6  # 3 rate-limited + plan + reply + re-ask
    assert usage.tokens == model.reported_tokens  # failed calls report no tokens; the rest exactly
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["model_calls"] == 6 and not result["correct"]


def test_context_budgets_reach_the_run(tmp_path: Path) -> None:
    model = EventChatModel(events=[ProviderError(404, "not found")])
    graph = compile_graph(sqlite_checkpointer(tmp_path / "ck.sqlite"))
    config = {"configurable": {"thread_id": "t"}}
    ctx = fast_context(
        tmp_path, model, max_model_calls=7, max_tokens=900, max_wall_s=60.0, patience=1, max_repairs=0
    )
    graph.invoke({"task_path": str(TASK), "out_dir": str(tmp_path / "out")}, config, context=ctx)
    values = graph.get_state(config).values
    b = values["budgets"]
    assert (b.max_model_calls, b.max_tokens, b.max_wall_s, b.patience) == (7, 900, 60.0, 1)
    assert values["max_repairs"] == 0
    # The plan's prompt alone (system prompt included) is over 900 tokens: the call is never made.
    assert model.calls == 0 and values["stop_reason"].startswith("token budget: the next call's prompt")


@pytest.mark.parametrize("killed", [False, True], ids=["model-failure-exit", "kill-9-mid-call"])
def test_usage_of_failed_calls_survives_the_process(tmp_path: Path, killed: bool) -> None:
    """Failed calls are charged to the store's ledger as they happen: a new process (no author, no
    in-memory counters) that resumes the run reports exactly the calls that got an answer or an error."""
    from fake_chat import Killed
    from maxkernel.nodes import common

    last = Killed("kill -9 while the third call is in flight") if killed else gemini_429("0.01s")
    model = EventChatModel(events=[gemini_429("0.01s"), gemini_429("0.01s"), last])
    config = {"configurable": {"thread_id": "t"}}
    ctx = fast_context(tmp_path, model)
    inp = {"task_path": str(TASK), "out_dir": str(tmp_path / "out"), "max_iterations": 1}
    with pytest.raises(Killed if killed else ModelCallError):
        compile_graph(sqlite_checkpointer(tmp_path / "ck.sqlite")).invoke(inp, config, context=ctx)
    common._AUTHORS.clear()  # the process is gone: its authors and their counters with it

    model.events = ["# Plan\nTiled matmul.", "I would tile it by 128.", "Still thinking about it."]
    graph = compile_graph(sqlite_checkpointer(tmp_path / "ck.sqlite"))
    graph.invoke(None, config, context=ctx)
    usage = graph.get_state(config).values["usage"]
    cut_short = 1 if killed else 0  # the call in flight at the kill never ended: no answer, no error
    assert model.calls == 6 and usage.model_calls == model.calls - cut_short
    assert usage.tokens == model.reported_tokens
    assert json.loads((tmp_path / "out" / "result.json").read_text())["model_calls"] == usage.model_calls
