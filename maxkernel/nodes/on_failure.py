"""on_failure (hitl only): a stage failed; the human chooses retry, feedback or stop."""

from __future__ import annotations

from typing import Literal

from langgraph.types import Command

from maxkernel.authors.reply import fenced
from maxkernel.nodes.review import FailureReview, ask
from maxkernel.state import AgentState, HumanFeedback


def on_failure(state: AgentState) -> Command[Literal["repair", "finalize"]]:
    r = state.eval_result
    assert r is not None and r.error is not None
    review = ask(
        "failure",
        f"Round {state.iteration}: the kernel failed at {r.error.stage} (repairs so far: {state.repairs}). "
        f"Accept to retry the repair, respond with a hint, or ignore to stop.\n\n{fenced(r.error.message)}",
        iteration=state.iteration,
        stage=r.error.stage,
        message=r.error.message,
        repairs_so_far=state.repairs,
    )
    assert isinstance(review, FailureReview)
    record = HumanFeedback(at="failure", action=review.action, text=review.feedback)
    if review.action == "stop":
        return Command(goto="finalize", update={"human": [record], "stop_reason": "stopped by a human"})
    update = {"human": [record]}
    if review.action == "feedback":
        update["feedback"] = review.feedback or ""
    return Command(goto="repair", update=update)
