"""test (tool node): read the correctness verdict of the current kernel and turn it into feedback."""

from __future__ import annotations

from typing import Any, Literal

from maxkernel.nodes.validate import can_repair
from maxkernel.state import AgentState


def test(state: AgentState) -> dict[str, Any]:
    r = state.eval_result
    assert r is not None
    if r.accepted:
        return {"feedback": None}
    c = r.correctness
    lines = [f"{r.error.stage}: {r.error.message}" if r.error else "not accepted"]
    if c is not None:
        lines.append(f"validated on {c.scale}: " + "; ".join(c.shapes_used))
        for s in c.sets:
            mark = "ok" if s.ok else f"WRONG ({s.message})"
            lines.append(f"  config {s.config} set {s.input_set} ({s.origin}): {mark}")
    return {"feedback": "\n".join(lines)}


def route_after_test(state: AgentState) -> Literal["autotune", "repair", "on_failure", "reflect"]:
    r = state.eval_result
    if r is None:
        raise ValueError("route_after_test: no evaluation result in state")
    if r.accepted:
        return "autotune"
    if state.mode == "hitl":
        return "on_failure"
    return "repair" if can_repair(state) else "reflect"
