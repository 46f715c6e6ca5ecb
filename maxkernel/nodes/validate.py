"""validate (tool node): evaluate the current kernel in the harness; failures go to the repair loop.

One sandboxed evaluation covers every stage (load, trace, Pallas check, TPU compile, correctness): it is
looked up in the results store first, so a re-run after a resume costs nothing. This node reads the
compile-side verdict; `test` reads the correctness side of the same result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from langgraph.runtime import Runtime

from maxkernel.context import Context
from maxkernel.nodes.common import better, budget_exhausted, run_eval, to_attempt
from maxkernel.nodes.finalize import write_best_so_far
from maxkernel.state import AgentState
from maxkernel.tools.results import COMPILE_STAGES


def validate(state: AgentState, runtime: Runtime[Context]) -> dict[str, Any]:
    assert state.source_path and state.source_hash
    source = Path(state.source_path).read_text()
    result = run_eval(state, runtime.context, source)
    attempt = to_attempt(
        state, state.attempt_kind, state.source_hash, state.source_path, result, config=state.source_config
    )
    update: dict[str, Any] = {"eval_result": result, "attempts": [attempt]}
    if better(attempt, state.best):
        update["best"] = attempt
        update["improved"] = True
        write_best_so_far(state, attempt)
    return update


def failed_at_validation(state: AgentState) -> bool:
    r = state.eval_result
    return r is not None and r.error is not None and r.error.stage in COMPILE_STAGES


def can_repair(state: AgentState) -> bool:
    return state.repairs < state.max_repairs and budget_exhausted(state) is None


def route_after_validate(state: AgentState) -> Literal["test", "repair", "on_failure", "reflect"]:
    if state.eval_result is None:
        raise ValueError("route_after_validate: no evaluation result in state")
    if not failed_at_validation(state):
        return "test"
    if state.mode == "hitl":
        return "on_failure"
    return "repair" if can_repair(state) else "reflect"
