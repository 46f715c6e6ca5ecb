"""When XLA cannot compile the reference for a generation (its program's temporaries exceed the chip's HBM,
as a GQA reference's [4, 128, 4096, 4096] f32 scores do on a 16 GiB v5e), the evaluation says so in the
estimate's note for that generation, with the compiler's figures, instead of "reference cost model failed";
the other generations keep their speedups."""

from __future__ import annotations

from maxkernel.tools.harness import _generation_summary
from maxkernel.tools.judge import reference_failure

OOM = (
    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (17.56G) "
    "exceeds available HBM (15.75G)."
)


def test_an_out_of_memory_reference_is_named_with_its_figures() -> None:
    why = reference_failure(RuntimeError(OOM))
    assert "does not fit" in why and "17.56G" in why and "15.75G" in why
    other = reference_failure(ValueError("an unsupported op\nmore detail"))
    assert other.startswith("XLA could not compile the reference") and "more detail" not in other


def test_the_note_of_that_generation_carries_the_reason() -> None:
    cand = {"estimated_seconds": 0.001, "bound": "compute", "method": "block model", "detail_markdown": ""}
    v5e = _generation_summary("v5e", cand, None, reference_failure(RuntimeError(OOM)))
    v6e = _generation_summary("v6e", cand, 0.002, None)
    assert v5e.estimated_speedup is None and "does not fit" in (v5e.note or "") and "v5e" in (v5e.note or "")
    assert v6e.estimated_speedup is not None and abs(v6e.estimated_speedup - 2.0) < 1e-9 and not v6e.note
