"""on_failure (hitl only): a stage failed; the human chooses retry, feedback or stop."""

from __future__ import annotations

from typing import Literal

from langgraph.types import Command, interrupt
from pydantic import BaseModel

from maxkernel.graph.state import AgentState, HumanFeedback
from maxkernel.nodes.plan import inbox_request, validated


class FailureReview(BaseModel):
    action: Literal["retry", "feedback", "stop"]
    feedback: str | None = None


def on_failure(state: AgentState) -> Command[Literal["repair", "finalize"]]:
    r = state.eval_result
    assert r is not None and r.error is not None
    review = validated(
        interrupt(
            {
                "kind": "failure",
                "iteration": state.iteration,
                "stage": r.error.stage,
                "message": r.error.message,
                "repairs_so_far": state.repairs,
                "actions": {
                    "retry": {"action": "retry"},
                    "feedback": {"action": "feedback", "feedback": "<hint for the repair>"},
                    "stop": {"action": "stop"},
                },
                **inbox_request(
                    "FailureReview",
                    f"Round {state.iteration}: the kernel failed at {r.error.stage} (repairs so far: "
                    f"{state.repairs}). Accept to retry the repair, respond with a hint, or ignore to stop."
                    f"\n\n```\n{r.error.message}\n```",
                    {"stage": r.error.stage, "message": r.error.message},
                ),
            }
        ),
        FailureReview,
    )
    assert isinstance(review, FailureReview)
    record = HumanFeedback(at="failure", action=review.action, text=review.feedback)
    if review.action == "stop":
        return Command(goto="finalize", update={"human": [record], "stop_reason": "stopped by a human"})
    update = {"human": [record]}
    if review.action == "feedback":
        update["feedback"] = review.feedback or ""
    return Command(goto="repair", update=update)
