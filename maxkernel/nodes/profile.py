"""profile (tool node): the trace summary and TPU time estimates of the current best kernel, as markdown
for the reflect step and the report. Estimates are labelled as estimates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from langgraph.runtime import Runtime

from maxkernel.context import Context
from maxkernel.nodes.common import run_eval
from maxkernel.state import AgentState
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
        for gen, g in e.by_generation.items():
            if gen != e.generation and g.estimated_speedup is not None:
                lines.append(f"- on {gen}: estimated speedup {g.estimated_speedup:.2f}x (bound: {g.bound})")
    if r.timing is not None:
        t = r.timing
        lines.append(
            f"Measured on {t.device}: candidate {t.candidate_median_s * 1e6:.1f} us "
            f"(IQR {t.candidate_spread_s * 1e6:.1f}), reference {t.reference_median_s * 1e6:.1f} us, "
            f"measured speedup {t.measured_speedup:.2f}x"
        )
    return "\n".join(lines) or "(no estimate or measurement available)"


def profile(state: AgentState, runtime: Runtime[Context]) -> dict[str, Any]:
    """Profile and summarise the best kernel (not the round's current one, which may be worse or wrong)."""
    best = state.best
    if best is None or not runtime.context.profile:
        return {}
    assert state.task is not None
    ctx = runtime.context
    r = run_eval(state, ctx, Path(best.source_path).read_text())  # a store hit: evaluated already
    summary = f"Best kernel so far: [{best.source_hash[:10]}] ({best.kind})\n" + render_estimate(r)
    if r.estimate and r.estimate.detail_markdown:
        summary += "\n\n" + r.estimate.detail_markdown
    from maxkernel.tools.profiling import profile_summary  # imports JAX: only when a run profiles

    trace = profile_summary(state.task, best.source_path, list(ctx.tpu), ctx.work_dir, r)
    return {"trace_summary": trace + "\n\n" + summary}
