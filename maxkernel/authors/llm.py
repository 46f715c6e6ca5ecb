"""`LLMAuthor`: any LangChain chat model as a kernel author, through the templates in maxkernel/prompts.

The model sees the reference source (as text: task code is never executed here), the shapes, the
tolerances, the JAX version and each target's peak numbers, the plan, the harness's verdicts and the
Pallas/TPU guide. Replies are parsed, not trusted (`authors.reply`): code is the module that defines
`computation`; truncated, thinking-only and code-less replies are re-asked once (counted); decisions come
from structured output, or JSON/keywords in text for models without it. Calls go through
`authors.model_calls` (timeout, retries honouring the provider's delay, rate limiter); a call that fails
for good raises `ModelCallError`, which ends the run in a named, resumable state.
Model-written kernels declare what the autotuner may vary in a module-level `TUNING_SPACE` literal dict.
Implement and repair may ask for tools (`authors.model_tools`): the author then returns a `ToolRequest`, the
graph's tool node runs the calls, and the step calls the author again with the conversation so far.
Plans and reflections are `PlanReply` / `ReflectionReply` (structured output with the raw reply kept, so a
parse that fails is read from the same reply's text).

Every reply is cached in the results store under a hash of (model, messages), so a node that re-runs after
a resume gets the same reply instead of a new (billed, different) one.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import re
import time
from itertools import product
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from maxkernel.authors import usage_ledger
from maxkernel.authors.base import (
    Attempt,
    AuthorContext,
    AuthorError,
    Draft,
    Plan,
    Reflection,
    TileConfig,
    ToolRequest,
)
from maxkernel.authors.model_calls import (
    CallSettings,
    invoke_with_retries,
    make_rate_limiter,
)
from maxkernel.authors.reply import (
    NoModule,
    ParsedReply,
    extract_json_object,
    extract_module,
    parse_message,
)
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
    """A chat model from an init_chat_model string. The provider's own retries are off (ours honour its
    retry delay and count every attempt); its request timeout is set where the integration takes one."""
    from langchain.chat_models import init_chat_model

    settings = settings or CallSettings()
    try:
        try:
            return init_chat_model(spec, max_retries=0, timeout=settings.timeout_s)
        except (TypeError, ValueError):  # an integration without these options: ours still apply
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

    def _call(self, messages: list[Any], runner: Any = None, key: str = "") -> Any:
        """One logical call with retries; every attempt is counted (and charged to run `key`)."""

        def failed(kind: str, exc: BaseException) -> None:
            self._charge(key, calls=1, failed=1)

        reply = invoke_with_retries(
            runner or self.model,
            messages,
            self.call_settings,
            rate_limiter=self.rate_limiter,
            sleep=self._sleep,
            on_failure=failed,
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
        tools_left = ctx.tools_left if want_code else 0
        # Bound while tools may be used, and after they were (providers reject tool turns with no tools).
        runner = self._tool_runner(ctx) if want_code and (tools_left > 0 or ctx.tool_messages) else None
        messages = list(conversation)
        if runner is not None and tools_left <= 0:
            messages.append(HumanMessage(TOOLS_SPENT))
        reasked = False
        while True:
            reply = self._call(messages, runner, ctx.usage_key)
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
        runner = _structured(self.model, schema)
        decision: BaseModel | None = None
        if runner is None:
            decision = read(self._ask(ctx, prompt))
        else:
            out = self._call(messages, _ParseTolerant(runner), ctx.usage_key)
            raw, parsed = (out.get("raw"), out.get("parsed")) if isinstance(out, dict) else (None, out)
            if raw is not None:
                self._count_tokens(messages, parse_message(raw), ctx.usage_key)
            else:  # structured output hid the provider's usage report: count what was sent
                self._charge(ctx.usage_key, tokens=sum(len(str(m.content)) for m in messages) // 4)
            try:
                decision = parsed if isinstance(parsed, schema) else schema.model_validate(parsed)
            except ValueError:  # the structured parse failed (or returned None): read the reply's text
                reply = parse_message(raw) if raw is not None else None
                if reply is not None and _reply_problem(reply, want_code=False) is None:
                    decision = read(reply.text)
                else:  # nothing usable (no raw reply, truncated, thinking only): ask in text, re-asking
                    decision = read(self._ask(ctx, prompt))
        if self.store is not None:
            self.store.put_model_reply(key, self.name, decision.model_dump_json())
        return decision

    def _common(self, ctx: AuthorContext) -> dict[str, str]:
        task = ctx.task
        ref = Path(task.reference_path).read_text(errors="replace")
        return {
            "task_id": task.task_id,
            "task_description": task.description or "(no description)",
            "reference_source": ref,
            "tpu_shapes": _shapes(task.configs),
            "validation_shapes": _shapes(task.validation_configs),
            "output_shapes": "; ".join(", ".join(map(str, c.outputs)) for c in task.configs),
            "tolerances": _tolerances(task),
            "targets": _targets(ctx.tpu),
            "starting_point": (
                f"A correct kernel already exists; improve on it:\n```python\n{ctx.starting_source}\n```"
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
                source=source,
                stage=stage.strip(),
                failure=message.strip() or failure,
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
        return Draft(source=source, notes=notes)

    def tuning_space(self, ctx: AuthorContext, plan: Plan) -> list[TileConfig]:
        """The configs the kernel declares in its module-level `TUNING_SPACE` dict (read with `ast`, never
        executed here); an empty list, logged, when it declares none."""
        source = plan.data.get("source", "")
        space = declared_tuning_space(source)
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
        for name, value in config.params:
            literal = repr(value)
            source, n = re.subn(
                rf"^{re.escape(name)}\s*(:\s*[^=\n]+)?=\s*[^\n#]+",
                f"{name} = {literal}",
                source,
                flags=re.MULTILINE,
            )
            if n == 0:
                raise AuthorError(f"TUNING_SPACE names {name} but the module has no top-level {name} = ...")
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
        reply = self._call(messages, key=key)
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


def declared_tuning_space(source: str) -> dict[str, list[int | str]] | None:
    """The module-level `TUNING_SPACE = {"BLOCK_M": [128, 256], ...}` of a kernel, read with `ast`
    (literal values only; the module is never executed here). None when absent or not a literal dict."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(node, ast.AnnAssign):
            target = node.target
        if isinstance(target, ast.Name) and target.id == "TUNING_SPACE" and node.value is not None:
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return None
            if not isinstance(value, dict):
                return None
            space = {
                str(k): [x for x in v if isinstance(x, int | str) and not isinstance(x, bool)]
                for k, v in value.items()
                if isinstance(v, list | tuple)
            }
            return {k: v for k, v in space.items() if v} or None
    return None


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
