"""Model calls: failures classified into named kinds, retries that honour the provider's delay, timeouts,
re-asks of truncated / thinking-only / code-less replies, and usage counted for every call."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage

from fake_chat import (
    KERNEL,
    EventChatModel,
    ProviderError,
    StallingChatModel,
    anthropic_message,
    gemini3_message,
    gemini_429,
    openai_message,
)
from maxkernel.authors.base import AuthorContext, AuthorError, Plan
from maxkernel.authors.llm import LLMAuthor
from maxkernel.authors.model_calls import (
    CallSettings,
    ModelCallError,
    classify,
    invoke_with_retries,
    retry_delay_s,
)
from maxkernel.tools.tasks import load_task

TASK = Path(__file__).parent / "data" / "tasks" / "small_matmul"
FAST = CallSettings(max_retries=3, timeout_s=5.0, backoff_initial_s=0.001, backoff_max_s=0.01)


class Header429(Exception):
    def __init__(self) -> None:
        super().__init__("Too Many Requests")
        self.response = type("R", (), {"status_code": 429, "headers": {"retry-after": "7"}})()


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (gemini_429(), "rate_limited"),
        (Header429(), "rate_limited"),
        (TimeoutError("read timed out"), "model_timeout"),
        (ConnectionError("Connection refused"), "model_unavailable"),
        (ProviderError(503, "UNAVAILABLE: the model is overloaded"), "model_unavailable"),
        (ProviderError(400, "API key not valid. Please pass a valid API key."), "model_auth"),
        (ProviderError(403, "PERMISSION_DENIED"), "model_auth"),
        (ProviderError(404, "models/gemini-9 is not found"), "model_not_found"),
        (ValueError("Invalid argument: contents"), "model_error"),
    ],
)
def test_classification(exc: Exception, kind: str) -> None:
    assert classify(exc) == kind


def test_retry_delay_from_gemini_retryinfo_header_and_attribute() -> None:
    assert retry_delay_s(gemini_429("37s")) == 37.0
    assert retry_delay_s(Header429()) == 7.0
    assert retry_delay_s(ProviderError(429, "Please retry in 1.5s.")) == 1.5
    assert retry_delay_s(ValueError("nothing")) is None


def test_retries_honour_the_provider_delay_then_succeed() -> None:
    model = EventChatModel(events=[gemini_429("3s"), TimeoutError("timed out"), "fine"])
    waits: list[float] = []
    settings = CallSettings(max_retries=3, timeout_s=5.0, backoff_initial_s=0.001, backoff_max_s=10.0)
    reply = invoke_with_retries(model, "hi", settings, sleep=waits.append)
    assert reply.content[-1]["text"] == "fine" and model.calls == 3
    assert waits[0] == 3.0  # the provider's 3 s beat our own 0.001 s backoff
    assert 0 < waits[1] <= 0.002


def test_permanent_failures_are_not_retried_and_transient_ones_give_up() -> None:
    model = EventChatModel(events=[ProviderError(404, "not found"), "never"])
    with pytest.raises(ModelCallError) as err:
        invoke_with_retries(model, "hi", FAST, sleep=lambda s: None)
    assert err.value.kind == "model_not_found" and not err.value.transient and model.calls == 1
    model = EventChatModel(events=[gemini_429()] * 4)
    with pytest.raises(ModelCallError) as err:
        invoke_with_retries(model, "hi", FAST, sleep=lambda s: None)
    assert err.value.kind == "rate_limited" and err.value.attempts == 4 and model.calls == 4


def test_a_stalled_call_times_out() -> None:
    model = StallingChatModel(stall_s=5.0)
    settings = CallSettings(max_retries=0, timeout_s=0.2)
    start = time.monotonic()
    with pytest.raises(ModelCallError) as err:
        invoke_with_retries(model, "hi", settings, sleep=lambda s: None)
    assert err.value.kind == "model_timeout" and time.monotonic() - start < 4
    assert model.events() == ["start", "cancelled"]  # not left running


def test_rate_limiter_is_used() -> None:
    calls: list[bool] = []

    class Limiter:
        def acquire(self, blocking: bool = True) -> bool:
            calls.append(blocking)
            return True

    invoke_with_retries(EventChatModel(events=["a"]), "hi", FAST, rate_limiter=Limiter())
    assert calls == [True]


@pytest.fixture(scope="module")
def actx(tmp_path_factory: pytest.TempPathFactory) -> AuthorContext:
    work = tmp_path_factory.mktemp("work")
    return AuthorContext(task=load_task(TASK, work_dir=work), tpu=["v5e", "v6e"], work_dir=work, scope="t")


def author(events: list, **kw: object) -> LLMAuthor:
    return LLMAuthor(EventChatModel(events=events, **kw), model_name="fake", call_settings=FAST)


PLAN = Plan(family="llm", summary="tiled", text="Tile M, N, K by 128.")


def test_truncated_and_thinking_only_replies_are_reasked_and_counted(actx: AuthorContext) -> None:
    a = author(
        [
            gemini3_message("```python\nimport jax\n", finish_reason="MAX_TOKENS"),
            AIMessage(content=[{"type": "thinking", "thinking": "hmm", "signature": "x"}]),
            "oops",
        ]
    )
    with pytest.raises(AuthorError, match="unusable twice"):
        a.implement(actx, PLAN)
    assert a.usage.model_calls == 2 and a.usage.reasked_calls == 1
    prompts = a.model.prompts
    assert "cut off by the output token limit" in prompts[1] and "MAX_TOKENS" in prompts[1]

    b = author([anthropic_message("No code, sorry."), anthropic_message("```python\n" + KERNEL + "```")])
    assert b.implement(actx, PLAN).source == KERNEL
    assert b.usage.model_calls == 2 and b.usage.reasked_calls == 1
    assert "no code" in b.model.prompts[1]


def test_usage_counts_every_call_and_estimates_when_unreported(actx: AuthorContext) -> None:
    a = author([gemini_429(), "```python\n" + KERNEL + "```"])
    a.implement(actx, PLAN)
    assert a.usage.model_calls == 2 and a.usage.failed_calls == 1
    assert a.usage.tokens == a.model.reported_tokens  # the provider's figures, exactly

    b = author([AIMessage(content="```python\n" + KERNEL + "```")])  # reports no usage at all
    b.implement(actx, PLAN)
    # system prompt + user prompt + reply, characters / 4: the system prompt alone is > 1000 tokens
    assert b.usage.tokens > (len(KERNEL) + 4000) // 4

    c = author([openai_message("```python\n" + KERNEL + "```")])
    c.implement(actx, PLAN)
    assert c.usage.tokens == 1200 + len("```python\n" + KERNEL + "```") // 4


def test_prompts_carry_tolerances_targets_and_the_tuning_convention(actx: AuthorContext) -> None:
    a = author(["```python\n" + KERNEL + "```"])
    draft = a.implement(actx, PLAN)
    prompt = a.model.prompts[0]
    assert "atol=" in prompt and "rtol=" in prompt and "JAX 0." in prompt
    assert "TFLOP/s" in prompt and "GB/s" in prompt and "VMEM" in prompt and "TUNING_SPACE" in prompt
    assert "declares no TUNING_SPACE" in draft.notes


def test_reflect_structured_output_and_fallback(actx: AuthorContext) -> None:
    ctx = actx.model_copy(update={"plan_text": "PLAN-TEXT-7", "tried_strategies": ["larger_tiles"]})
    s = author(
        ['{"decision": "continue", "next_strategy": "bf16_operands", "hint": "cast"}'], structured=True
    )
    r = s.reflect(ctx, [])
    assert r.action == "continue" and r.next_strategy == "bf16_operands" and r.plan_hint == "cast"
    prompt = s.model.prompts[0]
    assert "PLAN-TEXT-7" in prompt
    untried = prompt.split("## Strategies not tried yet")[1]
    assert "larger_tiles" not in untried and "bf16_operands" in untried

    f = author(['Thinking it over.\n```json\n{"decision": "STOP", "reason": "at roofline"}\n```'])
    r = f.reflect(ctx, [])
    assert r.action == "stop" and r.reasons == ["at roofline"]


def test_tuning_space_from_the_declared_dict(actx: AuthorContext) -> None:
    src = KERNEL.replace(
        "BLOCK_K = 128\n", 'BLOCK_K = 128\nTUNING_SPACE = {"BLOCK_M": [128, 256], "BLOCK_K": [128, 512]}\n'
    )
    a = author([])
    plan = PLAN.model_copy(update={"data": {"source": src}})
    space = a.tuning_space(actx, plan)
    assert len(space) == 4
    cfg = next(c for c in space if c.as_dict() == {"BLOCK_M": 256, "BLOCK_K": 512})
    rendered = a.render(actx, plan, cfg).source
    assert "BLOCK_M = 256\n" in rendered and "BLOCK_K = 512\n" in rendered and "BLOCK_N = 128\n" in rendered
    assert a.tuning_space(actx, PLAN.model_copy(update={"data": {"source": KERNEL}})) == []


def _tool_call(name: str, args: dict, call_id: str) -> dict:
    return {"name": name, "args": args, "id": call_id, "type": "tool_call"}


LOOKUP = _tool_call("lookup_pallas_api", {"name": "pl.BlockSpec"}, "c1")
CHECK = _tool_call("check_draft", {"source": "def computation(:\n"}, "c2")


def test_the_author_asks_for_tools_and_answers_without_them_once_spent(actx: AuthorContext) -> None:
    from langchain_core.messages import ToolMessage

    from maxkernel.authors.base import ToolRequest
    from maxkernel.authors.llm import TOOLS_SPENT

    ask = AIMessage(content="", tool_calls=[LOOKUP])
    a = author([ask])
    req = a.implement(actx.model_copy(update={"tools_left": 2, "scope": "tools-1"}), PLAN)
    assert isinstance(req, ToolRequest) and req.message.tool_calls[0]["name"] == "lookup_pallas_api"
    assert a.usage.model_calls == 1 and a.usage.tool_calls == 1

    # The tools' answer is in the conversation; the budget is spent: the model is told to answer now.
    spent = actx.model_copy(
        update={
            "tools_left": 0,
            "scope": "tools-1",
            "tool_messages": [ask, ToolMessage("sig", tool_call_id="c1")],
        }
    )
    b = author([ask, "```python\n" + KERNEL + "```"])
    assert b.implement(spent, PLAN).source == KERNEL  # asking again for tools is an unusable reply: re-asked
    assert TOOLS_SPENT in b.model.prompts[0]
    assert b.usage.reasked_calls == 1 and TOOLS_SPENT in b.model.prompts[1]


def test_tool_node_runs_tools_in_the_graph_and_a_resume_does_not_redo_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """plan → implement (asks lookup) → model_tools → implement (killed mid-call) | new process: resume →
    implement (asks check + lookup; budget 2: the lookup is not run) → model_tools → implement (code) →
    stop before validate. The look-up ran once in all; the draft check ran in the sandboxed harness."""
    import maxkernel.authors.model_tools as model_tools
    from fake_chat import Killed
    from maxkernel.authors.llm import TOOLS_SPENT
    from maxkernel.checkpointing import sqlite_checkpointer
    from maxkernel.context import Context
    from maxkernel.graph.agent import build_graph
    from maxkernel.nodes import common
    from maxkernel.nodes.tool_node import NOT_RUN

    looked_up: list[str] = []
    real_lookup = model_tools.lookup_pallas_api

    def lookup_pallas_api(name: str) -> str:
        """Signature and docstring of a JAX/Pallas API."""
        looked_up.append(name)
        return real_lookup(name)

    monkeypatch.setattr(model_tools, "lookup_pallas_api", lookup_pallas_api)
    model = EventChatModel(
        events=["# Plan\nTiled matmul.", AIMessage(content="", tool_calls=[LOOKUP]), Killed("kill -9")]
    )
    ctx = Context(model="fake:events", chat_model=model, tpu=["v5e"], store_path=str(tmp_path / "r.db"),
                  work_dir=str(tmp_path / "work"), baseline=False, model_tools=2)  # fmt: skip
    config = {"configurable": {"thread_id": "tools"}}

    def graph() -> object:
        saver = sqlite_checkpointer(tmp_path / "ck.sqlite")
        return build_graph().compile(checkpointer=saver, interrupt_before=["validate"])

    with pytest.raises(Killed):
        graph().invoke({"task_path": str(TASK), "max_iterations": 1}, config, context=ctx)
    common._AUTHORS.clear()  # a new process
    g = graph()
    saved = g.get_state(config).values
    assert saved["tool_caller"] == "implement" and [type(m).__name__ for m in saved["tool_messages"]] == [
        "AIMessage",
        "ToolMessage",
    ]
    assert "pl.BlockSpec(block_shape" in saved["tool_messages"][1].content

    model.events = [
        AIMessage(content="", tool_calls=[CHECK, {**LOOKUP, "id": "c3"}]),
        gemini3_message("```python\n" + KERNEL + "```"),
    ]
    g.invoke(None, config, context=ctx)
    state = g.get_state(config)
    assert state.next == ("validate",) and state.values["tool_messages"] == []
    # once: the resumed run did not redo it, and the over-budget one never ran
    assert looked_up == ["pl.BlockSpec"]
    history = [s.values for s in g.get_state_history(config) if s.values.get("tool_messages")]
    answers = {m.tool_call_id: m.content for v in history for m in v["tool_messages"] if m.type == "tool"}
    assert answers["c2"].startswith("failed at ") and answers["c3"] == NOT_RUN
    assert model.prompts[-1] == TOOLS_SPENT  # the budget (2) is spent: the last call was told to answer
    assert state.values["usage"].model_calls == 4  # plan, two tool turns, the code (the killed call: none)


def test_reflect_node_keeps_the_models_one_strategy(actx: AuthorContext, tmp_path: Path) -> None:
    from langgraph.runtime import Runtime

    from maxkernel.context import Context
    from maxkernel.nodes.reflect import reflect
    from maxkernel.state import AgentState, Attempt

    best = Attempt(iteration=1, kind="implement", source_hash="ab" * 8, source_path=str(tmp_path / "k.py"),
                   stage="accepted", accepted=True, estimated_speedup=1.5, estimated_bound="memory")  # fmt: skip
    (tmp_path / "k.py").write_text(KERNEL)
    state = AgentState(task_path=str(TASK), task=actx.task, iteration=1, max_iterations=3, improved=True,
                       best=best, attempts=[best], strategy="full_k_panel")  # fmt: skip

    def run(reply: str) -> dict:
        model = EventChatModel(events=[reply])
        store = tmp_path / f"r{len(reply)}.db"  # a store per reply: the same step's reply is cached by design
        ctx = Context(model="fake", chat_model=model, tpu=["v5e"], store_path=str(store))
        return reflect(state, Runtime(context=ctx))

    chosen = run('{"decision": "continue", "next_strategy": "bf16_operands", "hint": "cast to bf16"}')
    assert chosen["strategy"] == "bf16_operands" and chosen["feedback"] == "cast to bf16"
    assert chosen["tried_strategies"] == ["full_k_panel"]
    open_choice = run('{"decision": "continue", "hint": "bigger tiles"}')
    assert open_choice["strategy"] == "larger_tiles"  # the profile's pick only when the model left it open


PLAN_JSON = '{"summary": "tiled matmul, fused epilogue", "strategy": "larger_tiles", "plan": "Tile by 256."}'


def test_plan_structured_output_chooses_one_strategy(actx: AuthorContext) -> None:
    s = author([PLAN_JSON], structured=True)
    p = s.plan(actx)
    assert (p.summary, p.strategy, p.text) == ("tiled matmul, fused epilogue", "larger_tiles", "Tile by 256.")
    assert s.usage.model_calls == 1 and s.usage.tokens == s.model.reported_tokens
    assert "(your choice)" in s.model.prompts[0] and "Strategy: <name>" in s.model.prompts[0]

    # The round already has a strategy: it is the plan's, whatever the model names (chosen once).
    given = author([PLAN_JSON], structured=True)
    p = given.plan(actx.model_copy(update={"strategy": "full_k_panel", "scope": "t2"}))
    assert p.strategy == "full_k_panel" and "(your choice)" not in given.model.prompts[0]


@pytest.mark.parametrize("shape", [gemini3_message, anthropic_message, openai_message])
@pytest.mark.parametrize("structured", [True, False])
def test_plan_from_markdown_when_structured_output_fails_or_is_missing(
    actx: AuthorContext, structured: bool, shape: Any
) -> None:
    text = "# Fused matmul + bias + relu\nStrategy: **fuse_chain**\nTile M, N by 128."
    a = author([shape(text)], structured=structured)
    p = a.plan(actx.model_copy(update={"scope": f"md{structured}{shape.__name__}"}))
    # one reply, read from its text: a failed structured parse never costs a second call
    assert a.model.calls == 1 and a.usage.model_calls == 1
    assert p.summary == "Fused matmul + bias + relu" and p.strategy == "fuse_chain"
    assert p.text.startswith("# Fused matmul") and "thinking" not in p.text.lower()
    assert a.usage.tokens == 1200 + len(text) // 4  # the provider's usage report, whatever its shape


def test_plan_node_records_the_models_strategy_as_the_rounds(actx: AuthorContext, tmp_path: Path) -> None:
    from langgraph.runtime import Runtime

    from maxkernel.context import Context
    from maxkernel.nodes.plan import plan
    from maxkernel.state import AgentState

    def run(strategy: str | None) -> Any:
        model = EventChatModel(events=[PLAN_JSON], structured=True)
        ctx = Context(
            model="fake", chat_model=model, tpu=["v5e"], store_path=str(tmp_path / f"{strategy}.db")
        )
        state = AgentState(task_path=str(TASK), task=actx.task, strategy=strategy)
        return plan(state, Runtime(context=ctx)).update

    chosen = run(None)
    assert chosen["strategy"] == "larger_tiles" and chosen["plan"].strategy == "larger_tiles"
    kept = run("cache_reused_block")
    assert "strategy" not in kept and kept["plan"].strategy == "cache_reused_block"


def test_the_cli_shows_tool_requests_and_answers() -> None:
    from langchain_core.messages import RemoveMessage, ToolMessage

    from maxkernel.cli.run_progress import describe

    ask = AIMessage(content="", tool_calls=[CHECK, LOOKUP])
    line = describe("implement", {"tool_messages": [ask]}, {})
    assert "asks for check_draft(source=<1 lines>), lookup_pallas_api(name='pl.BlockSpec')" in line
    answer = ToolMessage("failed at load: SyntaxError\n  detail", tool_call_id="c2", name="check_draft")
    assert describe("model_tools", {"tool_messages": [answer]}, {}).endswith(
        "check_draft → failed at load: SyntaxError"
    )
    assert describe("implement", {"tool_messages": [RemoveMessage(id="__remove_all__")]}, {}).endswith(
        "implement"
    )


def test_a_truncated_structured_plan_is_asked_again_not_taken(actx: AuthorContext) -> None:
    cut = gemini3_message('{"summary": "tiled", "plan": "Tile M by', finish_reason="MAX_TOKENS")
    a = author([cut, "# Tiled matmul\nStrategy: larger_tiles\nTile M, N by 256."], structured=True)
    p = a.plan(actx.model_copy(update={"scope": "cut"}))
    assert p.strategy == "larger_tiles" and p.text.startswith("# Tiled matmul")
    assert a.usage.model_calls == 2 and a.usage.tokens == a.model.reported_tokens
