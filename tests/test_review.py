"""Terminal review: verbatim display, the interactive prompt (stdin injected), `resume` without a flag,
agent-inbox shaped payloads and responses, and `runs` statuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import maxkernel.cli.agent_commands as agent_commands
from maxkernel.cli import app
from maxkernel.cli.terminal_review import interactive_review, show_review
from maxkernel.nodes.review import CodeReview, FailureReview, PlanReview, validated
from maxkernel.runs import shown_status

TASK = Path(__file__).parent / "data" / "tasks" / "small_matmul"
TRICKY = "o_ref[...] = x_ref[i] + y_ref[pl.ds(0, 8)]  # [/] [bold]not markup[/bold]\n"


def answers(*replies: str):  # noqa: ANN201 - a fake `input`
    it = iter(replies)

    def ask(prompt: str) -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return ask


def test_review_body_is_printed_verbatim_when_piped(capsys: pytest.CaptureFixture[str]) -> None:
    show_review({"kind": "code_review", "iteration": 1, "code": TRICKY})
    assert TRICKY in capsys.readouterr().out


@pytest.mark.parametrize(
    ("payload", "replies", "expected"),
    [
        ({"kind": "plan_review", "plan": "P"}, ["a"], {"action": "approve"}),
        (
            {"kind": "plan_review", "plan": "P"},
            ["x", "f", "fuse less"],
            {"action": "reject", "feedback": "fuse less"},
        ),
        ({"kind": "plan_review", "plan": "P"}, ["e"], {"action": "replace", "plan": "P edited"}),
        ({"kind": "code_review", "code": TRICKY}, ["e"], {"action": "edit", "code": TRICKY + " edited"}),
        (
            {"kind": "code_review", "code": TRICKY},
            ["f", "use bf16"],
            {"action": "feedback", "feedback": "use bf16"},
        ),
        ({"kind": "failure", "stage": "compile", "message": "oom"}, ["s"], {"action": "stop"}),
        ({"kind": "failure", "stage": "compile", "message": "oom"}, ["r"], {"action": "retry"}),
        ({"kind": "plan_review", "plan": "P"}, ["l"], None),
        ({"kind": "plan_review", "plan": "P"}, [], None),  # EOF: leave it paused
    ],
)
def test_interactive_answers(payload: dict, replies: list[str], expected: dict | None) -> None:
    value = interactive_review(payload, ask=answers(*replies), edit=lambda text, suffix: text + " edited")
    assert value == expected


def test_unchanged_edit_asks_again() -> None:
    value = interactive_review(
        {"kind": "plan_review", "plan": "P"}, ask=answers("e", "a"), edit=lambda text, suffix: text
    )
    assert value == {"action": "approve"}


@pytest.mark.parametrize(
    ("response", "schema", "expected"),
    [
        ([{"type": "accept", "args": None}], PlanReview, PlanReview(action="approve")),
        ({"type": "edit", "args": {"action": "PlanReview", "args": {"plan": "new"}}}, PlanReview,
         PlanReview(action="replace", plan="new")),
        ([{"type": "response", "args": "smaller tiles"}], CodeReview, CodeReview(action="feedback", feedback="smaller tiles")),
        ([{"type": "ignore", "args": None}], FailureReview, FailureReview(action="stop")),
        ({"action": "retry"}, FailureReview, FailureReview(action="retry")),
    ],
)  # fmt: skip
def test_agent_inbox_responses(response: object, schema: type, expected: object) -> None:
    assert validated(response, schema) == expected


def test_an_offered_action_only() -> None:
    with pytest.raises(ValueError, match="does not answer"):
        validated([{"type": "ignore", "args": None}], PlanReview)


def test_runs_shows_never_started(tmp_path: Path) -> None:
    row = {"thread_id": "t1", "status": "running"}
    assert shown_status(row, {"checkpoint_db": str(tmp_path / "none.sqlite")}) == "never started"
    assert shown_status({**row, "status": "rate_limited"}, {}) == "rate_limited"


def test_resume_without_a_flag_shows_the_review_and_answers_interactively_on_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    store = ["--store", str(tmp_path / "store.db")]
    runner = CliRunner()
    first = runner.invoke(
        app,
        ["optimize", str(TASK), "--model", "offline", "--mode", "hitl", "--iterations", "1", "--tpu", "v5e",
         "--tune-configs", "0", "--thread-id", "rv-1", "--checkpoint-db", str(tmp_path / "ck.sqlite"),
         "--work-dir", str(tmp_path / "work"), *store],
    )  # fmt: skip
    assert first.exit_code == 3, first.output
    shown = runner.invoke(app, ["resume", "rv-1", *store])  # no flag, not a terminal: show it
    assert shown.exit_code == 3, shown.output
    assert "waiting for review" in shown.output and "plan_review" in shown.output
    assert "answer with: maxkernel resume rv-1 --approve" in shown.output

    # A terminal: approve the plan, then leave the code review paused.
    monkeypatch.setattr(agent_commands, "stdin_is_terminal", lambda: True)
    monkeypatch.setattr("builtins.input", answers("a", "l"))
    second = runner.invoke(app, ["resume", "rv-1", *store])
    assert second.exit_code == 3, second.output
    assert "paused for review (code_review)" in second.output and "pallas_call" in second.output
    runs = runner.invoke(app, ["runs", *store, "--json"])
    assert json.loads(runs.output.strip().splitlines()[-1])["status"] == "paused:code_review"


def test_a_run_whose_model_cannot_be_created_is_failed_to_start(tmp_path: Path) -> None:

    store = ["--store", str(tmp_path / "store.db")]
    runner = CliRunner()
    bad = runner.invoke(
        app,
        ["optimize", str(TASK), "--model", "no_such_provider:model-x", "--thread-id", "bad-1",
         "--checkpoint-db", str(tmp_path / "ck.sqlite"), "--work-dir", str(tmp_path / "work"), *store],
    )  # fmt: skip
    assert bad.exit_code == 2, bad.output
    runs = runner.invoke(app, ["runs", *store, "--json"])
    assert json.loads(runs.output.strip().splitlines()[-1])["status"] == "failed to start"


def _checkpointed(tmp_path: Path, thread_id: str) -> str:
    """A checkpoint database holding one row for the thread (all `runs` looks for)."""
    import sqlite3

    db = tmp_path / "ck.sqlite"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS checkpoints (thread_id TEXT)")
        conn.execute("INSERT INTO checkpoints VALUES (?)", (thread_id,))
    return str(db)


def test_runs_shows_a_killed_run_as_interrupted_and_resumable(tmp_path: Path) -> None:
    """A real process takes the thread's lease and records itself as the owner; while it lives the run is
    'running', after `kill -9` it is 'interrupted (process gone), resumable'."""
    import os
    import signal
    import subprocess
    import sys

    from maxkernel.tools.store import ResultsStore

    store = tmp_path / "store.db"
    settings = json.dumps({"checkpoint_db": _checkpointed(tmp_path, "k1")})
    owner = (
        "import sys, time\nfrom pathlib import Path\nfrom maxkernel import runs\n"
        "from maxkernel.tools.store import ResultsStore\n"
        f"st = ResultsStore({str(store)!r})\nruns.take_lease(st, 'k1')\n"
        f"st.upsert_run('k1', status='running', settings={settings!r}, "
        "**runs.owner())\n"
        "print('ready', flush=True)\ntime.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", owner], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        row = ResultsStore(store).get_run("k1")
        assert row is not None and row["owner_pid"] == proc.pid
        assert shown_status(row, json.loads(settings), store) == "running"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert shown_status(row, json.loads(settings), store) == "interrupted (process gone), resumable"
    shown = CliRunner().invoke(app, ["runs", "--store", str(store), "--json"])
    line = json.loads(shown.output.strip().splitlines()[-1])
    assert line["status"] == "running" and line["shown_status"].startswith("interrupted (process gone)")

    # No lease file: the pid decides; another host: this machine cannot tell, so it says where it runs.
    other = {**row, "thread_id": "k2"}
    never = {"checkpoint_db": _checkpointed(tmp_path, "k2")}
    assert shown_status(other, never, store).startswith("interrupted (process gone)")
    assert shown_status({**other, "owner_pid": os.getpid()}, never, store) == "running"
    remote = shown_status({**other, "owner_host": "tpu-host-7"}, never, store)
    assert remote.startswith("running on tpu-host-7, last step ")


@pytest.mark.parametrize("kind", ["plan_review", "code_review", "failure"])
def test_interrupt_is_a_list_of_one_agent_inbox_request_and_takes_its_response(kind: str) -> None:
    """What the agent inbox requires (a list holding one HumanInterrupt, typed as langgraph.prebuilt's
    TypedDicts say) and what it sends back (a list of one HumanResponse) round-trip through a real graph."""
    import warnings

    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import Command
    from typing_extensions import TypedDict

    from maxkernel.nodes.review import REVIEWS, ask, pending_review

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from langgraph.prebuilt.interrupt import ActionRequest, HumanInterrupt, HumanInterruptConfig

    class S(TypedDict, total=False):
        answer: dict

    shown = {"plan": "P", "code": "C", "stage": "compile", "message": "boom", "iteration": 1}

    def node(state: S) -> S:
        return {"answer": ask(kind, "**review** this", **shown).model_dump()}  # type: ignore[arg-type]

    g = StateGraph(S)
    g.add_node("review", node)
    g.add_edge(START, "review")
    g.add_edge("review", END)
    graph = g.compile(checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": kind}}
    graph.invoke({}, config)
    value = graph.get_state(config).tasks[0].interrupts[0].value
    assert isinstance(value, list) and len(value) == 1
    request = value[0]
    assert HumanInterrupt.__required_keys__ <= set(request) and request["description"] == "**review** this"
    assert set(request["action_request"]) == set(ActionRequest.__annotations__)
    assert isinstance(request["action_request"]["args"], dict) and request["action_request"]["args"]
    assert set(request["config"]) == set(HumanInterruptConfig.__annotations__)
    assert all(isinstance(v, bool) for v in request["config"].values())
    assert pending_review(value)["kind"] == kind  # what the terminal review reads

    # The inbox answers "accept" as a list of one response; it becomes the review point's own action.
    accept = [{"type": "accept", "args": request["action_request"]}]
    out = graph.invoke(Command(resume=accept), config)
    assert out["answer"]["action"] == REVIEWS[kind].inbox["accept"]
