"""Signals the harness adds from its own measurements (no child process needed to check them)."""

from __future__ import annotations

from maxkernel.tools.harness import INTERPRET_SLOW_FLOOR_S, INTERPRET_SLOW_RATIO, _interpret_cost_signal
from maxkernel.tools.results import EvalResult


def test_an_interpret_run_far_slower_than_the_reference_is_named() -> None:
    slow = EvalResult(task_id="t", source_hash="h")
    _interpret_cost_signal(slow, 60.0, {"reference": 0.5})
    assert len(slow.warnings) == 1 and slow.warnings[0].startswith("interpret cost:")
    assert "120x" in slow.warnings[0]

    usual = EvalResult(task_id="t", source_hash="h")
    _interpret_cost_signal(usual, 3.0, {"reference": 1.0})  # 3x: what interpret mode normally costs
    tiny = EvalResult(task_id="t", source_hash="h")
    _interpret_cost_signal(tiny, INTERPRET_SLOW_FLOOR_S / 2, {"reference": 0.001})  # under the noise floor
    unknown = EvalResult(task_id="t", source_hash="h")
    _interpret_cost_signal(unknown, 100.0, {"reference": "forged"})  # no trusted reference time
    assert usual.warnings == tiny.warnings == unknown.warnings == []
    assert INTERPRET_SLOW_RATIO > 3
