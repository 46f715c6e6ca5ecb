"""`LLMAuthor`: any LangChain chat model as a kernel author, through the templates in maxkernel/prompts.

The model sees the reference source (as text: task code is never executed here), the shapes, the
tolerances, the JAX version and each target's peak numbers, the plan, the harness's verdicts and the
Pallas/TPU guide. Replies are parsed, not trusted (`authors.reply`): code is the module that defines
`computation`; truncated, thinking-only and code-less replies are re-asked once (counted); decisions come
from structured output, or JSON/keywords in text for models without it. Calls go through
`authors.model_calls` (timeout, retries honouring the provider's delay, rate limiter), the ONE layer that
retries; a call that fails for good raises `ModelCallError`, which ends the run in a named, resumable
state. The run's budgets (`AuthorContext.budget`) are checked before every call, re-asks and retries
included; a spent one raises `BudgetSpent`, which stops the run with that budget as the reason. A provider
that rejects tools or structured output at call time (HTTP 400 from a model without tool support behind a
tool-capable API) is asked again in plain text, and the plain protocol is kept for the rest of the thread.
Model-written kernels declare what the autotuner may vary in a module-level `TUNING_SPACE` literal dict.
Implement and repair may ask for tools (`authors.model_tools`): the author then returns a `ToolRequest`, the
graph's tool node runs the calls, and the step calls the author again with the conversation so far.
Plans and reflections are `PlanReply` / `ReflectionReply` (structured output with the raw reply kept, so a
parse that fails is read from the same reply's text).

Every reply is cached in the results store under a hash of (model, messages), so a node that re-runs after
a resume gets the same reply instead of a new (billed, different) one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from itertools import product
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from maxkernel.authors import usage_ledger
from maxkernel.authors.base import (
    Attempt,
    AuthorContext,
    AuthorError,
    BudgetSpent,
    Draft,
    Plan,
    Reflection,
    RunBudget,
    TileConfig,
    ToolRequest,
)
from maxkernel.authors.model_calls import (
    CallSettings,
    ModelCallError,
    invoke_with_retries,
    make_rate_limiter,
)
from maxkernel.authors.reply import (
    NoModule,
    ParsedReply,
    extract_json_object,
    extract_module,
    fenced,
    parse_message,
)
from maxkernel.authors.tuning_space import declared_tuning_space, set_constants, settable_constants
from maxkernel.prompts import render, system_prompt
from maxkernel.tools.store import ResultsStore

log = logging.getLogger(__name__)


class LLMUsage(BaseModel):
    """Every call counts, failed ones included: a provider bills (and rate-limits) attempts, not successes."""

    model_calls: int = Field(0, description="calls sent to the provider, failed and re-asked ones included")
    failed_calls: int = Field(0, description="calls that raised (429, timeout, network, ...)")
    reasked_calls: int = Field(
        0, description="extra calls after a truncated, thinking-only or code-less reply"
    )
    cached_calls: int = 0
    tool_calls: int = Field(0, description="tool calls the model made (API look-ups, draft checks)")
    tokens: int = Field(
        0, description="as reported by the provider; characters/4 of system+prompt+reply when it reports none"
    )


class ReflectionReply(BaseModel):
    """The reflect decision (structured output, or JSON parsed from free text)."""

    decision: Literal["continue", "stop"] = Field("continue", description="another round, or stop")
    reason: str = Field("", description="why, in one sentence")
    next_strategy: str | None = Field(None, description="ONE strategy for the next round")
    hint: str | None = Field(None, description="what the next plan should change and why")

    @field_validator("decision", mode="before")
    @classmethod
    def _norm(cls, v: Any) -> Any:
        return str(v).strip().lower() if v is not None else "continue"


TOOLS_SPENT = "The tool budget of this step is spent: answer now, without tools."


class PlanReply(BaseModel):
    """The plan decision (structured output, or JSON / markdown read from free text)."""

    summary: str = Field("", description="one line: the kernel this plan writes")
    strategy: str | None = Field(
        None,
        description="the ONE optimisation strategy the plan applies: the given one when the prompt names "
        "it, else your own choice (a library name or a few words)",
    )
    plan: str = Field(
        description="the plan in markdown: computation, kernel structure, tiling, bytes moved, VMEM, tuning"
    )


def init_model(spec: str, settings: CallSettings | None = None) -> Any:
    """A chat model from an init_chat_model string. The provider's own retries are off (`model_calls` is the
    one layer that retries: it honours the provider's delay, checks the budgets and counts every attempt);
    its request timeout is set where the integration takes one."""
    from langchain.chat_models import init_chat_model

    settings = settings or CallSettings()
    try:
        for options in ({"max_retries": 0, "timeout": settings.timeout_s}, {"max_retries": 0}):
            try:
                return init_chat_model(spec, **options)
            except (TypeError, ValueError):  # an integration without these options: try with fewer
                continue
        log.warning("%s takes no max_retries: its SDK may retry on its own, under our --model-retries", spec)
        return init_chat_model(spec)
    except ImportError as exc:
        raise AuthorError(f"model {spec!r} needs its LangChain integration package: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - a bad model string is a usage error, reported as such
        raise AuthorError(f"cannot create chat model {spec!r}: {exc}") from exc


def extract_code(text: str) -> str:
    """The kernel module in a reply (see `reply.extract_module`); AuthorError when there is none."""
    try:
        return extract_module(text)
    except NoModule as exc:
        raise AuthorError(str(exc)) from exc


def _shapes(configs: list[Any]) -> str:
    return "; ".join(c.describe() for c in configs)


def _history(history: list[Attempt], *, ranked: bool = False) -> str:
    """Attempts as lines; `ranked`: accepted ones best first (measured before estimated), then failures."""
    if not history:
        return "(none yet)"
    items = list(history[-8:])
    if ranked:
        items = sorted(history, key=_rank, reverse=True)[:10]
    lines = []
    for a in items:
        verdict = "accepted" if a.accepted else f"failed at {a.stage}: {a.message[:400]}"
        cfg = f" {a.config}" if a.config else ""
        est = f", estimated {a.estimated_seconds * 1e6:.1f} us" if a.estimated_seconds else ""
        meas = f", measured {a.measured_seconds * 1e6:.1f} us" if a.measured_seconds else ""
        lines.append(f"- {a.kind}{cfg} [{a.source_hash[:8]}]: {verdict}{est}{meas}")
    return "\n".join(lines)


def _rank(a: Attempt) -> tuple[int, int, float]:
    if not a.accepted:
        return (0, 0, 0.0)
    if a.measured_seconds:
        return (1, 2, -a.measured_seconds)
    if a.estimated_seconds:
        return (1, 1, -a.estimated_seconds)
    return (1, 0, 0.0)


class LLMAuthor:
    """An `Author` backed by a chat model."""

    def __init__(
        self,
        model: Any,
        *,
        model_name: str | None = None,
        store: ResultsStore | None = None,
        call_settings: CallSettings | None = None,
        sleep: Any = None,
    ) -> None:
        self.call_settings = call_settings or CallSettings()
        self.model = init_model(model, self.call_settings) if isinstance(model, str) else model
        self.name = model_name or (model if isinstance(model, str) else type(model).__name__)
        self.store = store
        self.usage = LLMUsage()
        self.rate_limiter = make_rate_limiter(self.call_settings.requests_per_second)
        self._sleep = sleep or time.sleep
        # (calls, tokens) already written to a run's state (nodes.common.usage_of / usage_update)
        self.recorded: tuple[int, int] = (0, 0)
        # usage key (thread/branch) → features the provider refused there at call time (see `refused`)
        self._refusals: dict[str, set[str]] = {}

    # --- model access -----------------------------------------------------------------------------------
    def _messages(self, ctx: AuthorContext, prompt: str) -> list[Any]:
        from langchain_core.messages import HumanMessage, SystemMessage

        return [SystemMessage(system_prompt(ctx.tpu)), HumanMessage(prompt)]

    def _key(self, ctx: AuthorContext, messages: list[Any], kind: str = "text") -> str:
        return hashlib.sha256(
            json.dumps([self.name, ctx.scope, kind, [str(m.content) for m in messages]]).encode()
        ).hexdigest()

    def _charge(self, key: str, *, calls: int = 0, failed: int = 0, tokens: int = 0) -> None:
        """Count usage here and in the store's ledger under the run's key (`authors.usage_ledger`): the
        ledger outlives this process, so a kill or a failed step loses none of it."""
        self.usage.model_calls += calls
        self.usage.failed_calls += failed
        self.usage.tokens += tokens
        usage_ledger.record(self.store, key, calls=calls, failed=failed, tokens=tokens)

    def spent(self, ctx: AuthorContext) -> tuple[int, int]:
        """(calls, tokens) the run has spent so far: the store's ledger for the run when there is one (every
        call of every process), else what the run's state had when the step began plus this author's calls
        since it last wrote to the state (the same sum `nodes.common.usage_update` makes)."""
        budget = ctx.budget or RunBudget()
        if self.store is not None and ctx.usage_key:
            return usage_ledger.totals(self.store, ctx.usage_key, since=budget.started_at) or (0, 0)
        return (
            budget.calls + self.usage.model_calls - self.recorded[0],
            budget.tokens + self.usage.tokens - self.recorded[1],
        )

    def refused(self, ctx: AuthorContext) -> set[str]:
        """Features the provider refused in this thread: recorded in its state, or found by this process."""
        return set(ctx.refused) | self._refusals.get(ctx.usage_key, set())

    def refusals_for(self, usage_key: str) -> set[str]:
        """Features this process found refused for a run (the nodes copy them into its state)."""
        return set(self._refusals.get(usage_key, set()))

    def _note_refused(self, ctx: AuthorContext, feature: str, exc: ModelCallError) -> None:
        log.warning(
            "%s rejected a call with %s (%s); the plain text protocol is used for the rest of this thread",
            self.name,
            feature,
            exc.detail[:200],
        )
        self._refusals.setdefault(ctx.usage_key, set()).add(feature)

    def _call(self, ctx: AuthorContext, messages: list[Any], runner: Any = None) -> Any:
        """One logical call with retries; every attempt is checked against the run's budgets first, counted,
        and charged to the run (`ctx.usage_key`)."""
        key = ctx.usage_key

        def failed(kind: str, exc: BaseException) -> None:
            self._charge(key, calls=1, failed=1)

        reply = invoke_with_retries(
            runner or self.model,
            messages,
            self.call_settings,
            rate_limiter=self.rate_limiter,
            sleep=self._sleep,
            on_failure=failed,
            gate=_RunGate(self, ctx),
        )
        self._charge(key, calls=1)
        return reply

    def _count_tokens(self, messages: list[Any], parsed: ParsedReply, key: str = "") -> None:
        if parsed.total_tokens is not None:
            self._charge(key, tokens=int(parsed.total_tokens))
        else:  # no usage reported: count what was sent (system prompt included) and received
            sent = sum(len(str(m.content)) for m in messages)
            self._charge(key, tokens=(sent + len(parsed.text) + len(parsed.thinking)) // 4)

    def _ask(self, ctx: AuthorContext, prompt: str) -> str:
        """The answer text for `prompt` (no tools). See `_converse`."""
        answer = self._converse(ctx, prompt, want_code=False)
        assert isinstance(answer, str)
        return answer

    def _converse(self, ctx: AuthorContext, prompt: str, *, want_code: bool) -> str | ToolRequest:
        """The answer text for `prompt`, continuing this step's tool conversation (`ctx.tool_messages`), or
        a `ToolRequest` when the model asks for tools and the step may still use some (`ctx.tools_left`):
        the graph's tool node runs them and calls the step again. A truncated or thinking-only reply is
        re-asked once (shorter); with `want_code`, so is a reply without a kernel module. Final answers are
        cached per (scope, conversation), so a step re-run after a resume does not call the model again."""
        from langchain_core.messages import AIMessage, HumanMessage

        conversation = [*self._messages(ctx, prompt), *ctx.tool_messages]
        key = self._key(ctx, conversation)
        if self.store is not None:
            cached = self.store.get_model_reply(key)
            if cached is not None:
                self.usage.cached_calls += 1
                return cached
        tools_left = ctx.tools_left if want_code and "tools" not in self.refused(ctx) else 0
        # Bound while tools may be used, and after they were (providers reject tool turns with no tools).
        runner = self._tool_runner(ctx) if want_code and (tools_left > 0 or ctx.tool_messages) else None
        messages = list(conversation)
        if runner is not None and tools_left <= 0:
            messages.append(HumanMessage(TOOLS_SPENT))
        reasked = False
        while True:
            try:
                reply = self._call(ctx, messages, runner)
            except ModelCallError as exc:
                # A model that takes `bind_tools` and then rejects the call: the same messages in plain text.
                if runner is None or ctx.tool_messages or not feature_refused(exc):
                    raise
                runner, tools_left = None, 0
                reply = self._call(ctx, messages)
                self._note_refused(ctx, "tools", exc)
            parsed = parse_message(reply)
            self._count_tokens(messages, parsed, ctx.usage_key)
            requested = getattr(reply, "tool_calls", None) or []
            if requested and runner is not None and tools_left > 0:
                self.usage.tool_calls += len(requested)
                return ToolRequest(message=reply)
            text = parsed.text
            problem = _reply_problem(parsed, want_code)
            if problem is None:
                break
            if requested:
                problem += " " + TOOLS_SPENT
            if reasked:
                raise AuthorError(f"the model's reply was unusable twice: {problem}")
            reasked = True
            self.usage.reasked_calls += 1
            messages = [*messages, AIMessage(parsed.text or "(no answer text)"), HumanMessage(problem)]
        if self.store is not None:
            self.store.put_model_reply(key, self.name, text)
        return text

    def _tool_runner(self, ctx: AuthorContext) -> Any:
        """The model with the API-lookup and draft-check tools bound (`authors.model_tools`; the graph's
        tool node runs them), or None when the model cannot take tools."""
        from maxkernel.authors.model_tools import tools_for

        tools = tools_for(ctx.task, list(ctx.tpu), Path(ctx.work_dir), self.store)
        try:
            return self.model.bind_tools(tools)
        except (NotImplementedError, AttributeError, TypeError, ValueError):
            return None

    def _decide(
        self,
        ctx: AuthorContext,
        prompt: str,
        schema: type[BaseModel],
        fallback: Any = None,
    ) -> BaseModel:
        """A decision as `schema`: structured output where the model has it, else read from the reply's text
        (`fallback(text)`, default: JSON or `field: value` lines). A structured reply that does not validate
        is read from its own raw text: one reply, never a second call for the same decision."""
        read = fallback or (lambda text: parse_decision(text, schema))
        messages = self._messages(ctx, prompt)
        key = self._key(ctx, messages, kind=schema.__name__)
        if self.store is not None and (cached := self.store.get_model_reply(key)) is not None:
            self.usage.cached_calls += 1
            return schema.model_validate_json(cached)
        runner = None if "structured_output" in self.refused(ctx) else _structured(self.model, schema)
        if runner is None:
            decision = read(self._ask(ctx, prompt))
        else:
            decision = self._structured_decision(ctx, prompt, messages, runner, schema, read)
        if self.store is not None:
            self.store.put_model_reply(key, self.name, decision.model_dump_json())
        return decision

    def _structured_decision(
        self,
        ctx: AuthorContext,
        prompt: str,
        messages: list[Any],
        runner: Any,
        schema: type[BaseModel],
        read: Any,
    ) -> BaseModel:
        """One structured-output call; its raw text when the parse fails; the plain text protocol when the
        provider rejects structured output for this model (noted for the rest of the thread)."""
        try:
            out = self._call(ctx, messages, _ParseTolerant(runner))
        except ModelCallError as exc:
            if not feature_refused(exc):
                raise
            decision = read(self._ask(ctx, prompt))  # the plain text protocol, re-asks included
            self._note_refused(ctx, "structured_output", exc)
            return decision
        raw, parsed = (out.get("raw"), out.get("parsed")) if isinstance(out, dict) else (None, out)
        if raw is not None:
            self._count_tokens(messages, parse_message(raw), ctx.usage_key)
        else:  # structured output hid the provider's usage report: count what was sent
            self._charge(ctx.usage_key, tokens=sum(len(str(m.content)) for m in messages) // 4)
        try:
            return parsed if isinstance(parsed, schema) else schema.model_validate(parsed)
        except ValueError:  # the structured parse failed (or returned None): read the reply's text
            reply = parse_message(raw) if raw is not None else None
            if reply is not None and _reply_problem(reply, want_code=False) is None:
                return read(reply.text)
            return read(self._ask(ctx, prompt))  # nothing usable (truncated, thinking only): ask in text

    def _common(self, ctx: AuthorContext) -> dict[str, str]:
        task = ctx.task
        ref = Path(task.reference_path).read_text(errors="replace")
        return {
            "task_id": task.task_id,
            "task_description": task.description or "(no description)",
            "reference_source": fenced(ref, "python"),
            "tpu_shapes": _shapes(task.configs),
            "validation_shapes": _shapes(task.validation_configs),
            "output_shapes": "; ".join(", ".join(map(str, c.outputs)) for c in task.configs),
            "tolerances": _tolerances(task),
            "targets": _targets(ctx.tpu),
            "starting_point": (
                f"A correct kernel already exists; improve on it:\n{fenced(ctx.starting_source, 'python')}"
                if ctx.starting_source
                else "(none: write the first kernel)"
            ),
            "feedback": ctx.feedback or "(none)",
        }

    # --- Author ---------------------------------------------------------------------------------------
    def plan(self, ctx: AuthorContext) -> Plan:
        """The round's plan as a `PlanReply`. The strategy is chosen once: the round's (`ctx.strategy`, set
        by reflect, a human or a search branch) when there is one, else the model's own choice here."""
        prompt = render(
            "plan",
            **self._common(ctx),
            history=_history(ctx.history),
            strategy=_strategy_text(ctx.strategy),
        )
        reply = self._decide(ctx, prompt, PlanReply, fallback=parse_plan_text)
        assert isinstance(reply, PlanReply)
        text = reply.plan.strip()
        if not text:
            raise AuthorError("the model returned an empty plan")
        first = next((ln.strip("# ").strip() for ln in text.splitlines() if ln.strip()), "plan")
        summary = (reply.summary.strip() or first)[:200]
        chosen = ctx.strategy or (reply.strategy or "").strip() or None
        if ctx.strategy and reply.strategy and reply.strategy.strip() != ctx.strategy:
            log.info("plan named strategy %r; the round's strategy is %r", reply.strategy, ctx.strategy)
        return Plan(family="llm", summary=summary, text=text, strategy=chosen)

    def implement(self, ctx: AuthorContext, plan: Plan) -> Draft | ToolRequest:
        reply = self._converse(ctx, render("implement", **self._common(ctx), plan=plan.text), want_code=True)
        if isinstance(reply, ToolRequest):
            return reply
        return self._draft(extract_code(reply), f"written by {self.name}")

    def repair(
        self, ctx: AuthorContext, plan: Plan, source: str, failure: str, history: list[Attempt]
    ) -> Draft | ToolRequest:
        stage, _, message = failure.partition(":")
        reply = self._converse(
            ctx,
            render(
                "repair",
                **self._common(ctx),
                plan=plan.text,
                source=fenced(source, "python"),
                stage=stage.strip(),
                failure=fenced(message.strip() or failure),
                history=_history(history),
            ),
            want_code=True,
        )
        if isinstance(reply, ToolRequest):
            return reply
        return self._draft(extract_code(reply), f"repaired by {self.name}")

    def _draft(self, source: str, notes: str) -> Draft:
        space = declared_tuning_space(source)
        if space is None:
            notes += "; declares no TUNING_SPACE, so autotuning has nothing to vary"
        elif unset := sorted(set(space) - settable_constants(source)):
            notes += f"; TUNING_SPACE names {', '.join(unset)} but the module assigns no literal to it at top level"
        return Draft(source=source, notes=notes)

    def tuning_space(self, ctx: AuthorContext, plan: Plan) -> list[TileConfig]:
        """The configs the kernel declares in its module-level `TUNING_SPACE` dict (read with `ast`, never
        executed here), over the constants the module actually assigns (`authors.tuning_space`); an empty
        list, logged, when it declares none."""
        source = plan.data.get("source", "")
        space = declared_tuning_space(source)
        if space and (unset := set(space) - settable_constants(source)):
            log.warning(
                "TUNING_SPACE names %s, which the module never sets: not tuned", ", ".join(sorted(unset))
            )
            space = {k: v for k, v in space.items() if k not in unset}
        if not space:
            log.warning("the model's kernel declares no TUNING_SPACE: autotuning skipped for it")
            return []
        names = sorted(space)
        configs = [
            TileConfig.of(dict(zip(names, values, strict=True)))
            for values in product(*(space[n] for n in names))
        ]
        return configs

    def render(self, ctx: AuthorContext, plan: Plan, config: TileConfig) -> Draft:
        source = plan.data.get("source")
        if not source:
            raise AuthorError("no source to re-render: the plan carries none")
        try:
            source = set_constants(source, config.as_dict())
        except SyntaxError as exc:
            raise AuthorError(f"the kernel does not parse, so {config.label()} cannot be set: {exc}") from exc
        except KeyError as exc:
            raise AuthorError(
                f"TUNING_SPACE names {exc.args[0]} but the module assigns no literal to it at top level"
            ) from exc
        return Draft(source=source, config=config, notes=f"{self.name} kernel at {config.label()}")

    def write_reference(
        self, source: str, file_name: str, feedback: str = "", key: str = ""
    ) -> tuple[str, str]:
        """(framework, module source): a JAX reference in the problem-dir format for a CUDA, Triton or
        PyTorch file (`maxkernel convert --to pallas`). AuthorError when the reply holds no module."""
        from langchain_core.messages import HumanMessage

        prompt = render("convert", file_name=file_name, source=source,
                        feedback=f"## Feedback on your previous reference\n{feedback}" if feedback else "")  # fmt: skip
        messages = [HumanMessage(prompt)]
        # No task context yet (the reference is what is being written): charged to `key`, no run budget.
        reply = self._call(SimpleNamespace(usage_key=key, budget=None), messages)  # type: ignore[arg-type]
        parsed = parse_message(reply)
        self._count_tokens(messages, parsed, key)
        match = re.search(r"FRAMEWORK:\s*(cuda|triton|pytorch)", parsed.text, re.I)
        return (match.group(1).lower() if match else "unknown"), extract_code(parsed.text)

    def reflect(self, ctx: AuthorContext, history: list[Attempt]) -> Reflection:
        from maxkernel.strategies import strategy_names

        tried = set(ctx.tried_strategies)
        untried = [s for s in strategy_names() if s not in tried]
        prompt = render(
            "reflect",
            task_id=ctx.task.task_id,
            plan=ctx.plan_text or "(no plan recorded)",
            history=_history(history, ranked=True),
            profile=ctx.profile or "(no profile of the best kernel)",
            strategies=", ".join(untried) or "(all tried)",
            targets=_targets(ctx.tpu),
        )
        reply = self._decide(ctx, prompt, ReflectionReply)
        assert isinstance(reply, ReflectionReply)
        return Reflection(
            action=reply.decision,
            reasons=[reply.reason] if reply.reason else [],
            plan_hint=reply.hint or None,
            next_strategy=(reply.next_strategy or "").strip() or None,
        )


def _structured(model: Any, schema: type[BaseModel]) -> Any:
    """`with_structured_output(schema, include_raw=True)` (the raw reply keeps usage and text for a parse
    that fails), or without `include_raw` where an integration lacks it; None when the model has neither."""
    for kwargs in ({"include_raw": True}, {}):
        try:
            return model.with_structured_output(schema, **kwargs)
        except TypeError:
            continue
        except (NotImplementedError, AttributeError, ValueError):
            return None
    return None


class _ParseTolerant:
    """A structured-output runnable whose parse failures come back as None instead of raising, so they are
    not mistaken for provider failures (the text fallback handles them)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def invoke(self, messages: Any) -> Any:
        try:
            return self.runner.invoke(messages)
        except ValueError:  # OutputParserException, ValidationError, JSONDecodeError are ValueErrors
            return None

    async def ainvoke(self, messages: Any) -> Any:
        try:
            return await self.runner.ainvoke(messages)
        except ValueError:
            return None


class _RunGate:
    """The run's budgets as one call's retry loop sees them (`model_calls.CallGate`): before every attempt,
    what the run has spent (`LLMAuthor.spent`) and the prompt about to be sent, against `ctx.budget`."""

    def __init__(self, author: LLMAuthor, ctx: AuthorContext) -> None:
        self.author = author
        self.ctx = ctx

    def allow(self, messages: Any) -> float | None:
        budget = self.ctx.budget
        if budget is None:
            return None
        calls, tokens = self.author.spent(self.ctx)
        now = time.time()
        prompt = sum(len(str(getattr(m, "content", m))) for m in messages) // 4  # estimated, as unreported
        reason = budget.spent(calls, tokens, now, next_prompt_tokens=prompt)
        if reason is not None:
            raise BudgetSpent(reason)
        return budget.wall_left(now)

    def out_of_time(self) -> BudgetSpent:
        return BudgetSpent((self.ctx.budget or RunBudget()).wall_reason())


def feature_refused(exc: ModelCallError) -> bool:
    """Whether a failed call with tools or structured output may be the provider refusing that feature: a
    rejected request (HTTP 400/422), or a router's 404 'no endpoints that support tool use'. A plain call
    tells: the feature is only marked refused when the same messages then get an answer."""
    if exc.kind == "model_error":
        return True
    return exc.kind == "model_not_found" and _FEATURE_WORDS.search(exc.detail) is not None


_FEATURE_WORDS = re.compile(r"tool|function|structured|json|response_format|schema", re.IGNORECASE)


def _reply_problem(parsed: ParsedReply, want_code: bool) -> str | None:
    """What to tell the model when its reply cannot be used as is (None: it can)."""
    if parsed.truncated:
        return (
            f"Your reply was cut off by the output token limit (finish reason {parsed.finish_reason}). "
            "Reply again, shorter: no explanation, only the complete answer."
        )
    if parsed.thinking_only:
        return "Your reply held only thinking and no answer. Reply with the answer itself."
    if not parsed.text.strip():
        return "Your reply was empty. Reply with the answer."
    if want_code:
        try:
            extract_module(parsed.text)
        except NoModule as exc:
            return str(exc)
    return None


def parse_decision(text: str, schema: type[BaseModel]) -> BaseModel:
    """A decision from free text: a JSON object (fenced or bare, first that validates); else keywords."""
    raw = extract_json_object(text)
    if raw is not None:
        try:
            return schema.model_validate(json.loads(raw))
        except ValueError:
            pass
    fields = {}
    for name in schema.model_fields:
        m = re.search(rf"\**{name}\**\s*[:=]\s*\**\s*([^\n*]+)", text, re.IGNORECASE)
        if m:
            fields[name] = m.group(1).strip().strip("\"'`.,")
    if "decision" in schema.model_fields and "decision" not in fields:
        fields["decision"] = "stop" if re.search(r"\bstop\b", text, re.IGNORECASE) else "continue"
    try:
        return schema.model_validate(fields)
    except ValueError as exc:
        raise AuthorError(f"could not read a {schema.__name__} from the reply: {text[:200]!r}") from exc


_STRATEGY_LINE = re.compile(r"^\W*strategy\W*[:=]\s*(?P<name>[^\n]+)$", re.IGNORECASE | re.MULTILINE)


def parse_plan_text(text: str) -> PlanReply:
    """A plan from a model without structured output: a JSON object when the reply holds one that
    validates, else the markdown itself (summary: its first line; strategy: a `Strategy: ...` line)."""
    raw = extract_json_object(text)
    if raw is not None:
        try:
            return PlanReply.model_validate(json.loads(raw))
        except ValueError:
            pass
    text = text.strip()
    if not text:
        raise AuthorError("the model returned an empty plan")
    m = _STRATEGY_LINE.search(text)
    strategy = m.group("name").strip().strip("*`'\". ") if m else None
    return PlanReply(summary="", strategy=strategy or None, plan=text)


def _tolerances(task: Any) -> str:
    pairs = sorted({(c.atol, c.rtol) for c in task.validation_configs})
    return "; ".join(f"atol={a:g}, rtol={r:g}" for a, r in pairs) or "(harness defaults)"


def _targets(tpu: list[str]) -> str:
    """JAX version and each target's peak numbers, so a plan can reason about bytes and FLOPs."""
    import jax

    from maxkernel.tools.tpu_specs import get_spec

    lines = [f"JAX {jax.__version__} (write code for this version's Pallas API)"]
    for gen in tpu:
        try:
            s = get_spec(gen)
        except (KeyError, ValueError):
            lines.append(f"- {gen}: (unknown generation)")
            continue
        lines.append(
            f"- {s.display_name}: peak {s.peak_bf16_tflops:g} TFLOP/s bf16, HBM {s.hbm_gbps:g} GB/s, "
            f"VMEM {s.vmem_mib} MiB per core (default scoped limit {s.default_scoped_vmem_mib} MiB), "
            f"MXU {s.mxu_shape[0]}x{s.mxu_shape[1]}"
        )
    return "\n".join(lines)


def _strategy_text(name: str | None) -> str:
    if not name:
        return "(your choice)"
    from maxkernel.strategies import get_strategy

    try:
        return get_strategy(name).render()
    except KeyError:
        return name  # a free-form strategy from a human or a reflection
