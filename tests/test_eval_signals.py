"""Signals the harness adds from its own measurements (no child process needed to check them)."""

from __future__ import annotations

import pytest

from maxkernel.tools.candidate import (
    FAST_COMPILE_MAX_BYTES,
    INTERPRET_COMPILE_OPTIONS,
    pick_interpret_compile,
)
from maxkernel.tools.harness import INTERPRET_SLOW_FLOOR_S, INTERPRET_SLOW_RATIO, _interpret_cost_signal
from maxkernel.tools.results import ArraySpec, EvalResult, InputConfig


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


def test_interpret_compile_is_fast_for_small_sets_and_optimised_for_large_ones() -> None:
    def square(n: int) -> InputConfig:
        spec = ArraySpec(shape=(n, n), dtype="float32")
        return InputConfig(dynamic=[spec, spec], outputs=[spec], atol=1e-3, rtol=1e-3)

    small, large = square(256), square(2048)  # 768 KiB and 48 MiB of inputs and outputs per set
    assert pick_interpret_compile(small, 3) == "fast-compile"
    assert pick_interpret_compile(large, 1) == "optimised"
    # The budget counts every set run through the executable, not one.
    many = FAST_COMPILE_MAX_BYTES // (small.input_bytes() + small.output_bytes()) + 1
    assert pick_interpret_compile(small, many) == "optimised"
    assert set(INTERPRET_COMPILE_OPTIONS) >= {"fast-compile", "optimised"}
    assert INTERPRET_COMPILE_OPTIONS["optimised"] == {}  # XLA's own pipeline, unchanged
    for name in ("fast-compile", "no-fusion-emitters"):  # one codegen part: no thread pool on 2 cores
        assert INTERPRET_COMPILE_OPTIONS[name]["xla_cpu_parallel_codegen_split_count"] == 1


def test_an_optional_import_that_fails_is_tried_once() -> None:
    import sys

    from maxkernel.tools.worker import settle_optional_imports

    missing, present = "maxkernel_no_such_module_for_this_test", "json"
    try:
        assert settle_optional_imports((missing, present)) == {missing: False, present: True}
        assert sys.modules[missing] is None  # what Python itself records for a module known to be missing
        with pytest.raises(ModuleNotFoundError):
            __import__(missing)
    finally:
        sys.modules.pop(missing, None)
