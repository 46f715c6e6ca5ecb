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


def test_a_withheld_estimate_says_why_there_is_no_speedup() -> None:
    r = _result(None, "memory")
    assert r.estimate is not None
    r.estimate.estimated_seconds = None
    r.estimate.note = "estimate withheld: the block-model figures ... contradict the TPU program it shipped"
    v = verdict(r)
    assert v["outcome"] == "unknown" and v["speedup"] is None
    assert "no measured or estimated speedup" in v["line"] and "withheld" in v["line"]


def test_a_generation_without_a_reference_time_still_states_the_others() -> None:
    """XLA's reference does not fit v5e's HBM: no speedup there, said with the reason, and v6e's figure."""
    from maxkernel.tools.results import GenerationEstimate

    r = _result(None, "compute")
    assert r.estimate is not None
    r.estimate.note = "reference cost model failed (v5e): XLA's own program for the reference does not fit"
    r.estimate.by_generation = {
        "v5e": GenerationEstimate(estimated_speedup=None, bound="compute"),
        "v6e": GenerationEstimate(estimated_speedup=1.48, bound="compute"),
    }
    v = verdict(r)
    assert v["outcome"] == "unknown" and "does not fit" in v["line"] and "estimated 1.48x on v6e" in v["line"]


def test_a_generation_where_the_kernel_is_slower_is_said_so() -> None:
    """One kernel serves every targeted generation: faster on the first and slower on another is a mixed
    verdict, said per generation with the reason, never a plain "faster"."""
    from maxkernel.nodes.finalize import verdict_style
    from maxkernel.tools.results import GenerationEstimate

    r = _result(1.77, "compute")
    assert r.estimate is not None
    r.estimate.by_generation = {
        "v5e": GenerationEstimate(estimated_speedup=1.77, bound="compute"),
        "v6e": GenerationEstimate(estimated_speedup=0.66, bound="memory"),
    }
    v = verdict(r)
    assert v["outcome"] == "faster" and v["by_generation"]["v6e"] == {
        "outcome": "slower",
        "speedup": 0.66,
        "bound": "memory",
    }
    assert v["line"].startswith("faster than XLA: estimated 1.77x")
    assert "; SLOWER on v6e: estimated 0.66x (memory-bound; the kernel moves more HBM bytes" in v["line"]
    assert verdict_style(v["line"]) == "bold yellow"
    r.estimate.by_generation["v6e"] = GenerationEstimate(estimated_speedup=1.3, bound="compute")
    v = verdict(r)
    assert (
        "; faster on v6e: estimated 1.30x (compute-bound)" in v["line"]
        and verdict_style(v["line"]) == "bold green"
    )
    assert verdict_style(verdict(_result(0.5, "compute"))["line"]) == "bold red"
    assert "by_generation" not in verdict(_result(1.4, "memory"))  # one generation: as before
