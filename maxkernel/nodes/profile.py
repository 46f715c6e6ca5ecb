"""profile (tool node): the trace summary and TPU time estimates of the current best kernel, as markdown
for the reflect step and the report. Estimates are labelled as estimates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from langgraph.runtime import Runtime

from maxkernel.graph.context import Context
from maxkernel.graph.state import AgentState
from maxkernel.nodes.common import run_eval
from maxkernel.tools.results import EvalResult


def render_estimate(r: EvalResult) -> str:
    lines = []
    e = r.estimate
    if e is not None:
        lines.append(f"Estimated on {e.generation} ({e.method}):")
        if e.estimated_seconds is not None:
            lines.append(f"- candidate estimated time: {e.estimated_seconds * 1e6:.1f} us, bound: {e.bound}")
        if e.reference_estimated_seconds is not None:
            lines.append(
                f"- reference estimated time (XLA cost model): {e.reference_estimated_seconds * 1e6:.1f} us"
            )
        if e.estimated_speedup is not None:
            lines.append(f"- estimated speedup: {e.estimated_speedup:.2f}x")
        if e.note:
            lines.append(f"- note: {e.note}")
    if r.timing is not None:
        t = r.timing
        lines.append(
            f"Measured on {t.device}: candidate {t.candidate_median_s * 1e6:.1f} us "
            f"(IQR {t.candidate_spread_s * 1e6:.1f}), reference {t.reference_median_s * 1e6:.1f} us, "
            f"measured speedup {t.measured_speedup:.2f}x"
        )
    return "\n".join(lines) or "(no estimate or measurement available)"


def profile(state: AgentState, runtime: Runtime[Context]) -> dict[str, Any]:
    if state.best is None:
        return {}
    source = Path(state.best.source_path).read_text()
    r = run_eval(state, runtime.context, source)  # a store hit: the best kernel was evaluated already
    summary = f"Best kernel so far: [{state.best.source_hash[:10]}] ({state.best.kind})\n" + render_estimate(
        r
    )
    if r.estimate and r.estimate.detail_markdown:
        summary += "\n\n" + r.estimate.detail_markdown
    try:
        from maxkernel.tools.profiling import profile_summary

        assert state.task
        # The best kernel's own trace, not the current one's: reflect reads this as the best's profile.
        summary = (
            profile_summary(
                state.task, state.best.source_path, list(runtime.context.tpu), runtime.context.work_dir
            )
            + "\n\n"
            + summary
        )
    except ImportError:
        pass
    return {"trace_summary": summary}
