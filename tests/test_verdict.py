"""A result slower than XLA is reported as slower, with the reason; a rejected kernel is never a result."""

from __future__ import annotations

from maxkernel.nodes.finalize import verdict
from maxkernel.tools.results import EstimateSummary, EvalResult


def _result(speedup: float | None, bound: str, accepted: bool = True) -> EvalResult:
    est = EstimateSummary(
        generation="v5e", method="block model", estimated_seconds=2e-5, reference_estimated_seconds=1e-5,
        estimated_speedup=speedup, bound=bound,
    )  # fmt: skip
    return EvalResult(task_id="t", source_hash="h", accepted=accepted, correct=accepted, estimate=est)


def test_slower_is_said_with_the_reason() -> None:
    v = verdict(_result(0.5, "compute"))
    assert v["outcome"] == "slower" and v["kind"] == "estimated"
    assert v["line"].startswith("SLOWER than XLA: estimated 0.50x") and "compute-bound" in v["line"]
    assert "MXU" in v["line"]


def test_faster_and_error_band() -> None:
    assert verdict(_result(1.4, "memory"))["outcome"] == "faster"
    assert "error band" in verdict(_result(1.1, "memory"))["outcome"]


def test_rejected_kernel_is_no_result() -> None:
    v = verdict(_result(3.0, "memory", accepted=False))
    assert v["outcome"] == "no result" and "speedup" not in v
    assert verdict(None)["outcome"] == "no result"
