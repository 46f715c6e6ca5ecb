"""Result models shared by the agent side and the sandboxed worker.

Everything that crosses the sandbox boundary is one of these models serialised to JSON, so the agent
process never needs to import (or trust) anything the candidate produced. Measured numbers and estimated
numbers live in differently named fields and are never merged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, Field

from maxkernel.tools.tpu_specs import GENERATIONS


class StageInfo(BaseModel, frozen=True):
    """One stage of an evaluation: the single entry that adding a check takes (see `STAGE_TABLE`)."""

    name: str
    compile_class: bool = Field(description="a failure here goes back to the author as a build failure")
    in_progress: bool = Field(
        description="the candidate process announces it as it runs (so a hang or death is attributed to it)"
    )
    cached: bool = Field(True, description="a verdict at this stage may be stored and served again")
    doc: str = ""


STAGE_TABLE: tuple[StageInfo, ...] = (
    StageInfo(name="task", compile_class=True, in_progress=False, doc="the task itself is unusable"),
    StageInfo(
        name="infrastructure",
        compile_class=True,
        in_progress=False,
        cached=False,
        doc="the harness could not run (environment broken, sandbox failed to start): never a verdict",
    ),
    StageInfo(name="sandbox", compile_class=True, in_progress=False, doc="a policy violation or escape"),
    StageInfo(name="load", compile_class=True, in_progress=True, doc="importing the candidate"),
    StageInfo(name="trace", compile_class=True, in_progress=True, doc="tracing and lowering it"),
    StageInfo(name="pallas", compile_class=True, in_progress=False, doc="Pallas does the work (judge)"),
    StageInfo(name="consistency", compile_class=True, in_progress=False,
              doc="interpret/TPU and validation/production traces are the same program (judge)"),
    StageInfo(name="compile", compile_class=True, in_progress=False, doc="Mosaic AOT compile (judge)"),
    StageInfo(name="correctness", compile_class=False, in_progress=True, doc="outputs vs the reference"),
    StageInfo(name="timing", compile_class=False, in_progress=False, doc="measured on a real device"),
)  # fmt: skip
"""Every stage, in the order a verdict is decided. `Stage`, `STAGES` and the compile stages derive from it."""

STAGE_INFO: dict[str, StageInfo] = {s.name: s for s in STAGE_TABLE}
Stage = Literal[tuple(s.name for s in STAGE_TABLE)]  # type: ignore[valid-type]
STAGES: tuple[str, ...] = tuple(s.name for s in STAGE_TABLE)
COMPILE_STAGES: tuple[str, ...] = tuple(s.name for s in STAGE_TABLE if s.compile_class)
CANDIDATE_STAGES: tuple[str, ...] = tuple(s.name for s in STAGE_TABLE if s.in_progress)

TPU_GENERATIONS: tuple[str, ...] = GENERATIONS  # the one table is tools/tpu_specs.py

ScoreKind = Literal["measured", "estimated", "none"]
SCORE_KINDS: dict[int, ScoreKind] = {2: "measured", 1: "estimated", 0: "none"}
"""How a candidate ranks (the agent's `Attempt.score()`, search nodes, tuning rows) ↔ the kind of figure
it ranks by: a measured figure outranks any estimate, an estimate outranks none. The one mapping."""
SCORE_RANKS: dict[str, int] = {kind: rank for rank, kind in SCORE_KINDS.items()}


def geomean(values: list[float | None] | Any) -> float | None:
    """Geometric mean of the positive values (None and non-positive ones left out); None when none is left."""
    vals = [float(v) for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def ranking_speedup(first: float | None, by_generation: dict[str, float | None]) -> float | None:
    """The estimated figure a candidate is ranked by: one kernel serves every targeted TPU generation, so
    with several it is the geometric mean of their estimated speedups (a config that gains 3% on v5e and
    loses 30% on v6e ranks below one that does neither); with one, that generation's estimate. Named
    "geomean over generations" wherever it is shown; the per-generation figures are always kept beside it."""
    per_gen = [v for v in by_generation.values() if v is not None and v > 0]
    if len(per_gen) >= 2 and len(per_gen) == len(by_generation):
        return geomean(per_gen)
    return first


def np_dtype(name: str) -> Any:
    """numpy dtype from its name, including the ml_dtypes ones (bfloat16, float8_*) numpy lacks."""
    import ml_dtypes
    import numpy as np

    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def low_precision_float(name: str) -> bool:
    """bfloat16, float16 and the float8 kinds, by dtype name: looser default tolerances, and the judge's
    float32 run of the reference beside them (`judge.PRECISE_FILE`)."""
    return name in ("bfloat16", "float16") or name.startswith("float8")


def rounding_checked(output: str, inputs: Iterable[str]) -> bool:
    """Whether the judge keeps float32 runs of a reference output (`judge.PRECISE_FILE`), by dtype names:
    a low-precision float output, or a float32/64 one computed from low-precision float inputs. The latter
    carries the rounding of every low-precision op before its last, widening one (a bf16 mixture of
    experts combined with float32 router weights), and a kernel that rounds elsewhere in that chain is
    measured against the same float32 runs as a bf16 output would be."""
    return low_precision_float(output) or (
        output in ("float32", "float64") and any(low_precision_float(d) for d in inputs)
    )


class StageError(BaseModel):
    """Why an evaluation stopped: the stage it stopped in and a message a person (or a model) can act on."""

    stage: Stage
    message: str


def first_lines(text: str, n: int = 12) -> str:
    """The first `n` non-blank lines of an error, "..." when there were more: how much of a traceback or a
    compiler message a result's message carries."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return "\n".join(lines[:n]) + ("\n..." if len(lines) > n else "")


class ArraySpec(BaseModel):
    """Shape and dtype of one array; never the data."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def nbytes(self) -> int:
        return self.size * np_dtype(self.dtype).itemsize

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


class InputConfig(BaseModel):
    """One input configuration of a task: the dynamic arrays, the static arguments, tolerances."""

    dynamic: list[ArraySpec]
    static: list[Any] = Field(default_factory=list)
    outputs: list[ArraySpec] = Field(default_factory=list, description="flattened output leaves")
    atol: float
    rtol: float
    index_values: dict[int, Any] = Field(
        default_factory=dict,
        description="contents of the task's own small integer inputs (group sizes, lengths), by position: "
        "the block model replays index maps and guards that read them as scalar prefetch",
    )
    knobs: dict[str, int] = Field(
        default_factory=dict,
        description="the task generator's size literals as set for this configuration (`generator_knobs`); "
        "empty: the task's code as it is",
    )

    def input_bytes(self) -> int:
        return sum(a.nbytes() for a in self.dynamic)

    def output_bytes(self) -> int:
        return sum(a.nbytes() for a in self.outputs)

    def rounding_checked_outputs(self) -> list[ArraySpec]:
        """The outputs the judge keeps float32 runs of (`rounding_checked`)."""
        ins = [a.dtype for a in self.dynamic]
        return [o for o in self.outputs if rounding_checked(o.dtype, ins)]

    def describe(self) -> str:
        args = ", ".join(str(a) for a in self.dynamic)
        if self.static:
            args += "; static " + ", ".join(repr(s) for s in self.static)
        return args


class PallasCheck(BaseModel):
    """Whether Pallas does the work: what ran inside `pallas_call` kernels and what ran outside."""

    ok: bool
    reason: str | None = None
    pallas_calls: int = 0
    heavy_outside: list[str] = Field(
        default_factory=list,
        description="primitives outside Pallas that are not allowed there (dot, reduce, ...)",
    )
    elementwise_outside: list[str] = Field(
        default_factory=list,
        description="elementwise compute outside Pallas (reported; rejected if dominant)",
    )
    forbidden: list[str] = Field(default_factory=list, description="host callbacks and other escapes")
    work_inside: float = Field(
        0.0, description="element-ops + dot flops executed inside kernels (all grid steps)"
    )
    work_outside: float = Field(0.0, description="element-ops of elementwise compute outside kernels")


class SetCheck(BaseModel):
    """Correctness on one input set."""

    config: int
    input_set: int
    origin: Literal["task", "random"]
    ok: bool
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    mismatches: int = 0
    nan_outputs: int = 0
    message: str | None = None


class CorrectnessResult(BaseModel):
    ok: bool
    sets: list[SetCheck] = Field(default_factory=list)
    shapes_used: list[str] = Field(default_factory=list, description="validation shapes, one line per config")
    scale: str = Field("", description="how the validation shapes were chosen")
    larger_check: str = Field(
        "", description="the check at a second, larger shape: 'ran at <shapes>', or 'skipped: <why>'"
    )
    larger: SetCheck | None = Field(None, description="its one input set, when it ran (counts towards ok)")
    task_inputs: Literal["computed", "cached", ""] = Field(
        "", description="the task's own input sets: computed by its input generator in this evaluation's "
        "judge, or cached by the agent from an earlier evaluation of the same task (not secret; the "
        "fresh draws always are: see `reference_cache`)",
    )  # fmt: skip
    interpret_compile: list[str] = Field(
        default_factory=list,
        description="how each validation config's interpret-mode program was compiled (then the larger "
        "check's, when it ran): a `candidate.INTERPRET_COMPILE_OPTIONS` name",
    )
    interpret_modes: list[str] = Field(
        default_factory=list,
        description="how each of those programs was interpreted, in the same order: a "
        "`candidate.INTERPRET_MODES` name ('tpu' for every validation config; the larger check runs 'plain' "
        "when its program lowers so)",
    )
    max_abs_err: float | None = None
    max_rel_err: float | None = None


REFUSED_FOR_DEVICE = "the TPU program is refused for"
"""How a `CompileOutcome.error` starts when the program compiles for a generation but the judge's audit of
it says it is wrong there (a 'parallel' grid axis whose steps write one output block, on several cores)."""


class CompileOutcome(BaseModel):
    """Ahead-of-time Mosaic compile for one TPU generation at the task's own shapes."""

    ok: bool
    error: str | None = Field(None, description="the compiler's message, verbatim")
    seconds: float | None = None
    relayout_bytes: float = Field(
        0.0,
        description="HBM bytes of the copies the compiler put between the program's inputs and what its "
        "kernels read (an input whose TPU default layout is not the row-major one a kernel asks for), at the "
        "task's own shapes: read and written once each; the block model does not see them",
    )


class MeasuredTiming(BaseModel):
    """Wall-clock timing on a real accelerator. Only ever filled from a device run, never estimated."""

    device: str
    warmups: int
    runs: int
    candidate_median_s: float
    candidate_spread_s: float = Field(description="interquartile range of the timed runs")
    reference_median_s: float
    reference_spread_s: float
    measured_speedup: float
    rechecked_correct: bool


class GenerationEstimate(BaseModel):
    """One TPU generation's estimate of a candidate (block model) against the reference (compiler)."""

    kind: Literal["estimate"] = "estimate"
    estimated_seconds: float | None = None
    reference_estimated_seconds: float | None = None
    estimated_speedup: float | None = None
    bound: str | None = None
    note: str | None = None


class EstimateSummary(BaseModel):
    """The TPU time model's view of a candidate: estimated, never measured, and named so everywhere.
    The top-level figures are the first requested generation's; `by_generation` has every one's."""

    kind: Literal["estimate"] = "estimate"
    generation: str
    method: str = Field(description="how the numbers were obtained (block model, compiler cost model)")
    estimated_seconds: float | None = Field(None, description="candidate, block model of its pallas_calls")
    reference_estimated_seconds: float | None = Field(None, description="reference, TPU compiler cost model")
    estimated_speedup: float | None = None
    bound: str | None = Field(None, description="memory / compute / overhead, per the block model")
    note: str | None = None
    detail_markdown: str | None = Field(None, description="the block model's per-call table")
    by_generation: dict[str, GenerationEstimate] = Field(
        default_factory=dict, description="every requested generation's estimate, the first one included"
    )


class EvalResult(BaseModel):
    """Everything the harness learned about one candidate. `error` is None only when it was accepted."""

    task_id: str
    source_hash: str
    compiled: bool = Field(False, description="traced and lowered to a Pallas program (interpret mode)")
    correct: bool = False
    uses_pallas: bool = False
    accepted: bool = False
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    pallas: PallasCheck | None = None
    correctness: CorrectnessResult | None = None
    tpu_compile: dict[str, CompileOutcome] = Field(default_factory=dict)
    timing: MeasuredTiming | None = None
    estimate: EstimateSummary | None = None
    error: StageError | None = None
    warnings: list[str] = Field(default_factory=list)
    stage_seconds: dict[str, float] = Field(default_factory=dict)
    isolation: str = ""
    cached: bool = Field(False, description="served from the results store without re-running")

    def summary_json(self) -> dict[str, Any]:
        """The stable, documented JSON shape of `maxkernel eval --json`."""
        return self.model_dump(mode="json")
