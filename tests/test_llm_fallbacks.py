"""What real models do that the happy path does not expect: tools or structured output accepted by the API
client and refused by the provider at call time, a review card for a kernel whose docstring has a code
fence, a resumed thread's progress lines, and tuned constants written as a tuple."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from langgraph.runtime import Runtime
from langgraph.types import Command

from fake_chat import KERNEL, EventChatModel, ToolShyChatModel
from maxkernel.authors.base import AuthorContext, Plan
from maxkernel.authors.llm import LLMAuthor
from maxkernel.authors.model_calls import CallSettings, ModelCallError
from maxkernel.authors.reply import code_blocks
from maxkernel.checkpointing import sqlite_checkpointer
from maxkernel.context import Context
from maxkernel.graph.agent import build_graph
from maxkernel.nodes import common
from maxkernel.tools.tasks import load_task
from provider_errors import anthropic_error, gemini_error, openai_error

TASK = Path(__file__).parent / "data" / "tasks" / "small_matmul"
FAST = CallSettings(max_retries=2, timeout_s=5.0, backoff_initial_s=0.001, backoff_max_s=0.01)
PLAN_MD = "# Tiled matmul\nStrategy: larger_tiles\nTile M and N by 256."
CODE = "```python\n" + KERNEL + "```"
STOP = '{"decision": "stop", "reason": "good enough"}'

REFUSALS = {
    "gemini": gemini_error(400, "Function calling is not enabled for models/gemma-3-27b-it"),
    "openai-compatible": openai_error(
        400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    ),
    "anthropic": anthropic_error(400, "tools: this model does not support tool use"),
}


@pytest.fixture(scope="module")
def actx(tmp_path_factory: pytest.TempPathFactory) -> AuthorContext:
    work = tmp_path_factory.mktemp("work")
    return AuthorContext(
        task=load_task(TASK, work_dir=work), tpu=["v5e"], work_dir=work, scope="s", usage_key="thread/"
    )


@pytest.mark.parametrize("provider", sorted(REFUSALS))
def test_refused_tools_and_structured_output_fall_back_to_plain_text_for_the_thread(
    actx: AuthorContext, provider: str
) -> None:
    model = ToolShyChatModel(events=[PLAN_MD, CODE, CODE], structured=True, refusal=REFUSALS[provider])
    author = LLMAuthor(model, model_name="shy", call_settings=FAST)
    plan = author.plan(actx)
    assert plan.strategy == "larger_tiles" and model.kinds == ["structured", "plain"]
    draft = author.implement(actx.model_copy(update={"tools_left": 3, "scope": "s2"}), plan)
    assert draft.source == KERNEL and model.kinds[2:] == ["tools", "plain"]
    assert author.refused(actx) == {"structured_output", "tools"}
    # One refused call per feature, counted as failed calls; the rest of the thread asks in plain text only.
    assert author.usage.model_calls == 4 and author.usage.failed_calls == 2
    author.implement(actx.model_copy(update={"tools_left": 3, "scope": "s3"}), plan)
    assert model.kinds[4:] == ["plain"]
    # Another thread of the same author still tries (the refusal is the thread's, as its state records it).
    other = actx.model_copy(update={"usage_key": "other/", "scope": "o"})
    assert author.refused(other) == set()


def test_a_rejected_request_that_plain_text_cannot_cure_is_a_model_error(actx: AuthorContext) -> None:
    bad = gemini_error(400, "Request contains an invalid argument.")
    model = ToolShyChatModel(events=[], structured=True, refusal=bad, refuse_plain=True)
    author = LLMAuthor(model, model_name="broken", call_settings=FAST)
    with pytest.raises(ModelCallError) as err:
        author.plan(actx.model_copy(update={"scope": "bad"}))
    assert err.value.kind == "model_error" and model.kinds == ["structured", "plain"]
    assert author.refused(actx) == set()  # nothing learnt: the plain call failed too


def test_the_refusal_is_in_the_state_so_a_resumed_thread_does_not_meet_it_again(tmp_path: Path) -> None:
    refusal = REFUSALS["gemini"]
    model = ToolShyChatModel(events=[PLAN_MD, CODE], structured=True, refusal=refusal)
    ctx = Context(model="fake:shy", chat_model=model, tpu=["v5e"], store_path=str(tmp_path / "r.db"),
                  work_dir=str(tmp_path / "work"), baseline=False, model_tools=2)  # fmt: skip
    graph = build_graph().compile(
        checkpointer=sqlite_checkpointer(tmp_path / "ck.sqlite"), interrupt_before=["validate"]
    )
    config = {"configurable": {"thread_id": "shy"}}
    graph.invoke({"task_path": str(TASK), "max_iterations": 2}, config, context=ctx)
    values = graph.get_state(config).values
    assert values["refused_features"] == ["structured_output", "tools"]
    assert model.kinds == ["structured", "plain", "tools", "plain"]
    assert values["usage"].model_calls == 4

    common._AUTHORS.clear()  # a new process resumes the thread: its reflect step asks in plain text at once
    from maxkernel.nodes.reflect import reflect
    from maxkernel.state import AgentState

    model.events = [STOP]
    state = AgentState.model_validate(values)
    update = reflect(state, Runtime(context=ctx))
    assert update["stop_reason"] == "author: good enough" and model.kinds[4:] == ["plain"]


def test_a_code_review_card_shows_a_kernel_with_fences_in_its_docstring_whole(tmp_path: Path) -> None:
    kernel = KERNEL.replace(
        '"""',
        '"""Usage:\n\n```python\nout = computation(x, w, b)\n```\n\n````\nnested ``` fence\n````\n',
        1,
    )
    assert kernel.count("\n") > 25 and "```" in kernel
    model = EventChatModel(events=[PLAN_MD, "```````python\n" + kernel + "```````"])
    ctx = Context(model="fake:events", chat_model=model, tpu=["v5e"], store_path=str(tmp_path / "r.db"),
                  work_dir=str(tmp_path / "work"), baseline=False, model_tools=0)  # fmt: skip
    graph = build_graph().compile(checkpointer=sqlite_checkpointer(tmp_path / "ck.sqlite"))
    config = {"configurable": {"thread_id": "review"}}
    graph.invoke({"task_path": str(TASK), "mode": "hitl", "max_iterations": 1}, config, context=ctx)
    graph.invoke(Command(resume={"action": "approve"}), config, context=ctx)  # the plan review
    (card,) = [i.value[0] for t in graph.get_state(config).tasks for i in t.interrupts]
    assert card["kind"] == "code_review" and card["code"] == kernel
    blocks = code_blocks(card["description"])
    assert len(blocks) == 1 and blocks[0].code == kernel  # every line, in one block
    assert blocks[0].info == "python"


def test_resume_prints_the_threads_round(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    import maxkernel.cli.run_progress as run_progress

    model = EventChatModel(events=[PLAN_MD, gemini_error(404, "models/x is not found")])
    ctx = Context(model="fake:events", chat_model=model, tpu=["v5e"], store_path=str(tmp_path / "r.db"),
                  work_dir=str(tmp_path / "work"), baseline=False, model_tools=0)  # fmt: skip
    graph = build_graph().compile(
        checkpointer=sqlite_checkpointer(tmp_path / "ck.sqlite"), interrupt_before=["validate"]
    )
    config = {"configurable": {"thread_id": "round"}}
    with pytest.raises(ModelCallError):
        graph.invoke({"task_path": str(TASK), "max_iterations": 2}, config, context=ctx)
    assert graph.get_state(config).values["iteration"] == 1

    printed = Console(record=True, width=200)
    monkeypatch.setattr(run_progress, "console", printed)
    model.events = [CODE]
    run_progress.drive(graph, None, config, ctx)  # what `maxkernel resume` streams
    text = printed.export_text()
    assert "[round 1] implement" in text and "[round 0]" not in text


TUPLE_KERNEL = KERNEL.replace("BLOCK_M = 128\nBLOCK_N = 128\n", "BLOCK_M, BLOCK_N = 128, 128  # tiles\n")


def test_tuned_constants_written_as_a_tuple_are_tuned(actx: AuthorContext) -> None:
    assert "BLOCK_M, BLOCK_N = 128, 128" in TUPLE_KERNEL
    source = TUPLE_KERNEL.replace(
        "BLOCK_K = 128\n", 'BLOCK_K = 128\nTUNING_SPACE = {"BLOCK_M": [128, 256], "BLOCK_N": [128, 512]}\n'
    )
    author = LLMAuthor(EventChatModel(events=[]), model_name="t", call_settings=FAST)
    plan = Plan(family="llm", summary="tiled", text="Tile.", data={"source": source})
    space = author.tuning_space(actx, plan)
    assert len(space) == 4
    config = next(c for c in space if c.as_dict() == {"BLOCK_M": 256, "BLOCK_N": 512})
    rendered = author.render(actx, plan, config).source
    assert "BLOCK_M, BLOCK_N = 256, 512  # tiles\n" in rendered
    assert rendered.replace("256, 512", "128, 128") == source  # nothing else changed


def test_a_tuning_space_naming_constants_the_module_never_sets_tunes_the_rest(actx: AuthorContext) -> None:
    source = KERNEL.replace(
        "BLOCK_K = 128\n",
        'BLOCK_K = 128\nTUNING_SPACE = {"BLOCK_M": [128, 256], "BLOCK_Q": [1, 2]}\n',
    )
    author = LLMAuthor(
        EventChatModel(events=[CODE.replace(KERNEL, source)]), model_name="t", call_settings=FAST
    )
    draft: Any = author.implement(
        actx.model_copy(update={"scope": "unset"}), Plan(family="llm", summary="s", text="t")
    )
    assert "TUNING_SPACE names BLOCK_Q but the module assigns no literal to it" in draft.notes
    space = author.tuning_space(actx, Plan(family="llm", summary="s", text="t", data={"source": source}))
    assert sorted(c.as_dict()["BLOCK_M"] for c in space) == [128, 256]  # BLOCK_Q dropped, BLOCK_M tuned


def test_the_implement_prompt_says_which_forms_the_autotuner_reads(actx: AuthorContext) -> None:
    model = EventChatModel(events=[CODE])
    LLMAuthor(model, model_name="t", call_settings=FAST).implement(
        actx.model_copy(update={"scope": "prompt"}), Plan(family="llm", summary="s", text="t")
    )
    assert "BLOCK_M, BLOCK_N = 256, 128` also works" in model.prompts[0]


def test_a_daily_quota_ends_the_run_rate_limited_and_says_when_to_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import typer
    from rich.console import Console

    import maxkernel.cli.run_progress as run_progress
    from maxkernel.tools.store import ResultsStore
    from provider_errors import gemini_daily_quota

    model = EventChatModel(events=[gemini_daily_quota(), PLAN_MD])
    ctx = Context(model="fake:events", chat_model=model, tpu=["v5e"], store_path=str(tmp_path / "r.db"),
                  work_dir=str(tmp_path / "work"), baseline=False, model_retries=4)  # fmt: skip
    graph = build_graph().compile(checkpointer=sqlite_checkpointer(tmp_path / "ck.sqlite"))
    store = ResultsStore(tmp_path / "r.db")
    printed = Console(record=True, width=200)
    monkeypatch.setattr(run_progress, "console", printed)
    monkeypatch.setattr(run_progress, "out", printed)
    config = {"configurable": {"thread_id": "quota"}}
    with pytest.raises(typer.Exit) as exit_:
        run_progress.run_thread(graph, {"task_path": str(TASK)}, config, ctx, store, "quota")
    text = printed.export_text()
    assert exit_.value.exit_code == run_progress.EXIT_MODEL_FAILURE and model.calls == 1
    assert "rate_limited" in text and "after 1 attempt(s)" in text
    assert "expects to answer again after" in text and "in 3600 s" in text and "--backoff-max" in text
    assert "maxkernel resume quota" in text and store.get_run("quota")["status"] == "rate_limited"
