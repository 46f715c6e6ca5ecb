"""`LLMAuthor`: any LangChain chat model as a kernel author, through the templates in maxkernel/prompts.

The model sees the reference source (as text: task code is never executed here), the shapes, the plan, the
harness's verdicts and the Pallas/TPU guide. Replies are parsed, not trusted: code comes from the single
python block, reflections from a JSON object (or structured output where the model supports it).

Every reply is cached in the results store under a hash of (model, messages), so a node that re-runs after
a resume gets the same reply instead of a new (billed, different) one.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from maxkernel.authors.base import (
    Attempt,
    AuthorContext,
    AuthorError,
    Draft,
    Plan,
    Reflection,
    TileConfig,
)
from maxkernel.prompts import render, system_prompt
from maxkernel.tools.store import ResultsStore

_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
_BLOCK_CONST = re.compile(r"^(BLOCK_[A-Z0-9_]+)\s*=\s*(\d+)\s*(?:#.*)?$", re.MULTILINE)


class LLMUsage(BaseModel):
    model_calls: int = 0
    cached_calls: int = 0
    tokens: int = Field(0, description="as reported by the provider; characters/4 when it reports nothing")


class ReflectionReply(BaseModel):
    """The JSON a model returns from the reflect prompt."""

    decision: str = "continue"
    reason: str = ""
    next_strategy: str | None = None
    hint: str | None = None


def init_model(spec: str) -> Any:
    from langchain.chat_models import init_chat_model

    try:
        return init_chat_model(spec, max_retries=2)
    except ImportError as exc:
        raise AuthorError(f"model {spec!r} needs its LangChain integration package: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - a bad model string is a usage error, reported as such
        raise AuthorError(f"cannot create chat model {spec!r}: {exc}") from exc


def extract_code(text: str) -> str:
    blocks = _CODE_BLOCK.findall(text)
    if not blocks:
        if "def computation" in text:
            return text.strip() + "\n"
        raise AuthorError("the model's reply has no ```python code block")
    # The last block with `computation` in it is the module; earlier ones are usually snippets.
    with_entry = [b for b in blocks if "def computation" in b]
    return (with_entry[-1] if with_entry else blocks[-1]).strip() + "\n"


def _shapes(configs: list[Any]) -> str:
    return "; ".join(c.describe() for c in configs)


def _history(history: list[Attempt]) -> str:
    if not history:
        return "(none yet)"
    lines = []
    for a in history[-8:]:
        verdict = "accepted" if a.accepted else f"failed at {a.stage}: {a.message[:400]}"
        cfg = f" {a.config}" if a.config else ""
        est = f", estimated {a.estimated_seconds * 1e6:.1f} us" if a.estimated_seconds else ""
        meas = f", measured {a.measured_seconds * 1e6:.1f} us" if a.measured_seconds else ""
        lines.append(f"- {a.kind}{cfg} [{a.source_hash[:8]}]: {verdict}{est}{meas}")
    return "\n".join(lines)


class LLMAuthor:
    """An `Author` backed by a chat model."""

    def __init__(
        self, model: Any, *, model_name: str | None = None, store: ResultsStore | None = None
    ) -> None:
        self.model = init_model(model) if isinstance(model, str) else model
        self.name = model_name or (model if isinstance(model, str) else type(model).__name__)
        self.store = store
        self.usage = LLMUsage()

    # --- model access -----------------------------------------------------------------------------------
    def _ask(self, ctx: AuthorContext, prompt: str) -> str:
        from langchain_core.messages import HumanMessage, SystemMessage

        messages = [SystemMessage(system_prompt(ctx.tpu)), HumanMessage(prompt)]
        key = hashlib.sha256(
            json.dumps([self.name, ctx.scope, [m.content for m in messages]]).encode()
        ).hexdigest()
        if self.store is not None:
            cached = self.store.get_model_reply(key)
            if cached is not None:
                self.usage.cached_calls += 1
                return cached
        try:
            reply = self.model.invoke(messages)
        except Exception as exc:  # noqa: BLE001 - provider errors of every kind end this step, not the run
            raise AuthorError(f"model call failed: {type(exc).__name__}: {exc}") from exc
        text = reply.content if isinstance(reply.content, str) else _flatten(reply.content)
        self.usage.model_calls += 1
        meta = getattr(reply, "usage_metadata", None) or {}
        self.usage.tokens += int(meta.get("total_tokens") or (len(prompt) + len(text)) // 4)
        if self.store is not None:
            self.store.put_model_reply(key, self.name, text)
        return text

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
            "starting_point": (
                f"A correct kernel already exists; improve on it:\n```python\n{ctx.starting_source}\n```"
                if ctx.starting_source
                else "(none: write the first kernel)"
            ),
            "feedback": ctx.feedback or "(none)",
        }

    # --- Author ---------------------------------------------------------------------------------------
    def plan(self, ctx: AuthorContext) -> Plan:
        text = self._ask(
            ctx,
            render(
                "plan",
                **self._common(ctx),
                history=_history(ctx.history),
                strategy=_strategy_text(ctx.strategy),
            ),
        ).strip()
        if not text:
            raise AuthorError("the model returned an empty plan")
        summary = next((ln.strip("# ").strip() for ln in text.splitlines() if ln.strip()), "plan")
        return Plan(family="llm", summary=summary[:200], text=text)

    def implement(self, ctx: AuthorContext, plan: Plan) -> Draft:
        reply = self._ask(ctx, render("implement", **self._common(ctx), plan=plan.text))
        return Draft(source=extract_code(reply), notes=f"written by {self.name}")

    def repair(
        self, ctx: AuthorContext, plan: Plan, source: str, failure: str, history: list[Attempt]
    ) -> Draft:
        stage, _, message = failure.partition(":")
        reply = self._ask(
            ctx,
            render(
                "repair",
                **self._common(ctx),
                source=source,
                stage=stage.strip(),
                failure=message.strip() or failure,
                history=_history(history),
            ),
        )
        return Draft(source=extract_code(reply), notes=f"repaired by {self.name}")

    def tuning_space(self, ctx: AuthorContext, plan: Plan) -> list[TileConfig]:
        """Halve and double each top-level BLOCK_* constant of the current source, keeping (8, 128)
        alignment: a model's kernel has no analysed space, but its block constants are the usual knobs."""
        source = plan.data.get("source", "")
        consts = {name: int(v) for name, v in _BLOCK_CONST.findall(source)}
        if not consts:
            return []
        configs = {TileConfig.of(consts)}
        for name, value in consts.items():
            for new in (value // 2, value * 2):
                align = 128 if value % 128 == 0 else 8
                if new >= align and new % align == 0 and new <= 4096:
                    configs.add(TileConfig.of(consts, **{name: new}))
        return sorted(configs, key=lambda c: c.label())

    def render(self, ctx: AuthorContext, plan: Plan, config: TileConfig) -> Draft:
        source = plan.data.get("source")
        if not source:
            raise AuthorError("no source to re-render: the plan carries none")
        for name, value in config.params:
            source = re.sub(rf"^{name}\s*=\s*\d+", f"{name} = {value}", source, flags=re.MULTILINE)
        return Draft(source=source, config=config, notes=f"{self.name} kernel at {config.label()}")

    def reflect(self, ctx: AuthorContext, history: list[Attempt]) -> Reflection:
        from maxkernel.strategies import strategy_names

        prompt = render(
            "reflect",
            task_id=ctx.task.task_id,
            plan=ctx.feedback or "(see history)",
            history=_history(history),
            profile=ctx.profile or "(no profile)",
            strategies=", ".join(strategy_names()),
        )
        text = self._ask(ctx, prompt)
        match = re.search(r"\{.*\}", text, re.DOTALL)
        try:
            reply = ReflectionReply.model_validate_json(match.group(0)) if match else None
        except ValueError:
            reply = None
        if reply is None:
            return Reflection(action="continue", reasons=["the model's reflection was not valid JSON"])
        action = "stop" if reply.decision.strip().lower() == "stop" else "continue"
        hint = " ".join(
            x for x in (reply.next_strategy and f"Strategy: {reply.next_strategy}.", reply.hint) if x
        )
        return Reflection(
            action=action, reasons=[reply.reason] if reply.reason else [], plan_hint=hint or None
        )


def _strategy_text(name: str | None) -> str:
    if not name:
        return "(your choice)"
    from maxkernel.strategies import get_strategy

    try:
        return get_strategy(name).render()
    except KeyError:
        return name  # a free-form strategy from a human or a reflection


def _flatten(content: list[Any]) -> str:
    parts = []
    for item in content:
        if isinstance(item, str):
            parts.append(item)
        elif isinstance(item, dict) and item.get("type") == "text":
            parts.append(str(item.get("text", "")))
    return "".join(parts)
