"""Human review points (hitl): what each one accepts, in one table.

A node pauses with `ask(kind, ...)`; the interrupt carries the actions a client may send back; `answer`
turns the CLI's `resume` options into one of them. Adding an action or a review point is one row here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from langgraph.types import interrupt
from pydantic import BaseModel, ValidationError

ReviewKind = Literal["plan_review", "code_review", "failure"]


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


@dataclass(frozen=True)
class ReviewPoint:
    schema: type[BaseModel]
    actions: dict[str, dict[str, str]]
    """action → the resume value to send (placeholders in <>), shown to whoever answers."""
    cli: dict[str, tuple[str, str | None]]
    """`maxkernel resume` option → (action, the value's field the option's argument fills)."""


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
    ),
    "failure": ReviewPoint(
        schema=FailureReview,
        actions={
            "retry": {"action": "retry"},
            "feedback": {"action": "feedback", "feedback": "<hint for the repair>"},
            "stop": {"action": "stop"},
        },
        cli={"approve": ("retry", None), "feedback": ("feedback", "feedback"), "stop": ("stop", None)},
    ),
}


def validated(value: Any, schema: type[BaseModel]) -> BaseModel:
    try:
        return schema.model_validate(value)
    except ValidationError as exc:
        raise ValueError(f"invalid resume value for {schema.__name__}: {exc}") from exc


def ask(kind: ReviewKind, **shown: Any) -> Any:
    """Pause for a human; returns their answer validated against the review point's schema."""
    point = REVIEWS[kind]
    return validated(interrupt({"kind": kind, **shown, "actions": point.actions}), point.schema)


def answer(kind: str, option: str, value: str | None = None) -> dict[str, Any]:
    """The resume value for `maxkernel resume --OPTION [VALUE]` at a review of this kind; KeyError if the
    option does not answer it."""
    action, field = REVIEWS[kind].cli[option]
    return {"action": action, **({field: value} if field else {})}
