"""Human review points (hitl): what each one accepts, in one table.

A node pauses with `ask(kind, description, ...)`; the interrupt carries (in a list of one, as the agent inbox
wants) the actions a client may send back, plus the keys LangChain's agent inbox renders as an action card
(`action_request`, `config`, `description`);
`answer` turns the CLI's `resume` options into one of them, `validated` also takes an agent-inbox response.
Adding an action or a review point is one row here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from langgraph.types import interrupt
from pydantic import BaseModel, ValidationError

ReviewKind = Literal["plan_review", "code_review", "failure", "conversion_review"]


class PlanReview(BaseModel):
    """Resume value for a plan review."""

    action: Literal["approve", "replace", "reject"]
    plan: str | None = None
    feedback: str | None = None


class CodeReview(BaseModel):
    """Resume value for a code review."""

    action: Literal["approve", "edit", "feedback"]
    code: str | None = None
    feedback: str | None = None


class FailureReview(BaseModel):
    """Resume value after a failed stage."""

    action: Literal["retry", "feedback", "stop"]
    feedback: str | None = None


class ConversionReview(BaseModel):
    """Resume value for the review of a JAX reference converted from PyTorch, CUDA or Triton."""

    action: Literal["approve", "edit", "feedback", "stop"]
    code: str | None = None
    feedback: str | None = None


@dataclass(frozen=True)
class ReviewPoint:
    schema: type[BaseModel]
    actions: dict[str, dict[str, str]]
    """action → the resume value to send (placeholders in <>), shown to whoever answers."""
    cli: dict[str, tuple[str, str | None]]
    """`maxkernel resume` option → (action, the value's field the option's argument fills)."""
    inbox: dict[str, str | None]
    """agent-inbox response type (accept / edit / response / ignore) → action; None: that type not offered."""
    inbox_args: tuple[str, ...]
    """the payload fields an inbox card shows as its args; an `edit` response's args fill the first one."""


REVIEWS: dict[str, ReviewPoint] = {
    "plan_review": ReviewPoint(
        schema=PlanReview,
        actions={
            "approve": {"action": "approve"},
            "replace": {"action": "replace", "plan": "<new plan text>"},
            "reject": {"action": "reject", "feedback": "<what to change>"},
        },
        cli={
            "approve": ("approve", None),
            "plan_file": ("replace", "plan"),
            "feedback": ("reject", "feedback"),
        },
        inbox={"accept": "approve", "edit": "replace", "response": "reject", "ignore": None},
        inbox_args=("plan",),
    ),
    "code_review": ReviewPoint(
        schema=CodeReview,
        actions={
            "approve": {"action": "approve"},
            "edit": {"action": "edit", "code": "<the whole module>"},
            "feedback": {"action": "feedback", "feedback": "<what to change>"},
        },
        cli={
            "approve": ("approve", None),
            "code_file": ("edit", "code"),
            "feedback": ("feedback", "feedback"),
        },
        inbox={"accept": "approve", "edit": "edit", "response": "feedback", "ignore": None},
        inbox_args=("code",),
    ),
    "failure": ReviewPoint(
        schema=FailureReview,
        actions={
            "retry": {"action": "retry"},
            "feedback": {"action": "feedback", "feedback": "<hint for the repair>"},
            "stop": {"action": "stop"},
        },
        cli={"approve": ("retry", None), "feedback": ("feedback", "feedback"), "stop": ("stop", None)},
        inbox={"accept": "retry", "edit": None, "response": "feedback", "ignore": "stop"},
        inbox_args=("stage", "message"),
    ),
    "conversion_review": ReviewPoint(
        schema=ConversionReview,
        actions={
            "approve": {"action": "approve"},
            "edit": {"action": "edit", "code": "<the whole reference.py>"},
            "feedback": {"action": "feedback", "feedback": "<what the model should change>"},
            "stop": {"action": "stop"},
        },
        cli={
            "approve": ("approve", None),
            "code_file": ("edit", "code"),
            "feedback": ("feedback", "feedback"),
            "stop": ("stop", None),
        },
        inbox={"accept": "approve", "edit": "edit", "response": "feedback", "ignore": "stop"},
        inbox_args=("code",),
    ),
}


# Agent-inbox response type → the HumanInterrupt config flag that offers it.
INBOX_ALLOW = {
    "accept": "allow_accept",
    "edit": "allow_edit",
    "response": "allow_respond",
    "ignore": "allow_ignore",
}


def _point_of(schema: type[BaseModel]) -> ReviewPoint | None:
    return next((p for p in REVIEWS.values() if p.schema is schema), None)


def inbox_request(kind: ReviewKind, description: str, shown: dict[str, Any]) -> dict[str, Any]:
    """The keys an agent inbox / chat UI renders as an action card (HumanInterrupt), added to our payload."""
    point = REVIEWS[kind]
    return {
        "action_request": {
            "action": point.schema.__name__,
            "args": {name: shown.get(name) for name in point.inbox_args},
        },
        "config": {flag: point.inbox[t] is not None for t, flag in INBOX_ALLOW.items()},
        "description": description,
    }


def from_inbox(value: Any, schema: type[BaseModel]) -> Any:
    """An agent-inbox response ([{"type": "accept" | "edit" | "response" | "ignore", "args": ...}]) as our
    resume value; anything else is returned as is."""
    if isinstance(value, list) and value and isinstance(value[0], dict):
        value = value[0]
    if not (isinstance(value, dict) and value.get("type") in INBOX_ALLOW):
        return value
    point = _point_of(schema)
    action = point.inbox.get(value["type"]) if point is not None else None
    if point is None or action is None:
        raise ValueError(f"a {value['type']!r} response does not answer a {schema.__name__}")
    args = value.get("args")
    if value["type"] == "edit":
        edited = (args or {}).get("args", args) if isinstance(args, dict) else {}
        field = point.inbox_args[0]
        return {"action": action, field: edited.get(field)}
    if value["type"] == "response":
        return {"action": action, "feedback": str(args or "")}
    return {"action": action}


def validated(value: Any, schema: type[BaseModel]) -> BaseModel:
    """A resume value (ours, or an agent-inbox response) checked against a review point's schema."""
    try:
        return schema.model_validate(from_inbox(value, schema))
    except ValidationError as exc:
        raise ValueError(f"invalid resume value for {schema.__name__}: {exc}") from exc


def ask(kind: ReviewKind, description: str, **shown: Any) -> Any:
    """Pause for a human; returns their answer validated against the review point's schema. `description`
    is the agent-inbox card's text (markdown). The interrupt's value is a list of one request, as the agent
    inbox requires (it renders the first HumanInterrupt of the list and answers with a list of one
    HumanResponse); `pending_review` reads it back for the CLI."""
    point = REVIEWS[kind]
    payload = {"kind": kind, **shown, "actions": point.actions, **inbox_request(kind, description, shown)}
    return validated(interrupt([payload]), point.schema)


def pending_review(value: Any) -> dict[str, Any]:
    """The review request of an interrupt's value (`ask` sends a list of one)."""
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return value[0]
    if isinstance(value, dict):
        return value
    raise ValueError(f"not a review request: {value!r}")


def answer(kind: str, option: str, value: str | None = None) -> dict[str, Any]:
    """The resume value for `maxkernel resume --OPTION [VALUE]` at a review of this kind; KeyError if the
    option does not answer it."""
    action, field = REVIEWS[kind].cli[option]
    return {"action": action, **({field: value} if field else {})}
