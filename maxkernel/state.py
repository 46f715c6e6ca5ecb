"""The graphs' state: for the agent a narrow input and the richer state the nodes share (extending the
input, as the search's state extends its own), and the search's state and node records.

Big artifacts live on disk and in the results store: kernel sources are files under the run directory
named by their hash, evaluations are rows in the store. The state holds hashes, paths and the small
summaries a router or a human needs. Measured and estimated numbers keep separate names here too.
"""

from __future__ import annotations

import operator
from typing import Annotated, Any, Literal

from langchain_core.messages import AnyMessage
from langgraph.graph.message import add_messages
from pydantic import BaseModel, Field

from maxkernel.authors.base import Attempt as AuthorAttempt
from maxkernel.authors.base import Plan
from maxkernel.strategies import strategy_names
from maxkernel.tools.results import SCORE_KINDS, SCORE_RANKS, EvalResult, ScoreKind, ranking_speedup
from maxkernel.tools.tasks import KernelTask

Mode = Literal["auto", "hitl"]


class AgentInput(BaseModel):
    """What a caller gives the graph (`graph.invoke(AgentInput(...).model_dump())`)."""

    task_path: str = Field(description="task dir, reference.py or JAXBench module")
    mode: Mode = Field("auto", description="auto never interrupts; hitl asks a human at each review point")
    max_iterations: int = Field(3, ge=1, description="plan→…→reflect rounds at most")
    scale: str | None = Field(None, description="validation scale (cpu, tpu, or a shrink factor)")
    out_dir: str | None = Field(None, description="where finalize writes kernel.py, result.json, report.md")
    strategy: str | None = Field(None, description="optimisation strategy this run should apply first")
    tune_max_configs: int = Field(6, ge=0, description="configs the autotuner evaluates per round")
    max_repairs: int = Field(3, ge=0, description="repair attempts per round before giving up on the round")
    start_source_path: str | None = Field(None, description="a kernel to start from (search: the parent's)")
    label: str | None = Field(None, description="branch label in a search: scopes run dirs and model replies")


class Budgets(BaseModel):
    """Limits a caller does not set per run. The per-run ones (`max_iterations`, `tune_max_configs`,
    `max_repairs`) are input fields, read from the state: one default each, in `AgentInput`."""

    patience: int = Field(2, description="stop after this many rounds without improvement")
    max_model_calls: int = 60
    max_tokens: int = 400_000
    max_wall_s: float = 3600.0


class Usage(BaseModel):
    model_calls: int = 0
    tokens: int = 0
    started_at: float = Field(0.0, description="time.time() when prepare ran")


class Attempt(AuthorAttempt):
    """One evaluated kernel: enough to route, to report and to feed back to an author. It extends the
    author's view of an attempt (`authors.base.Attempt`) with what the graph routes and reports by, so the
    history an author is given is the graph's own records, not copies of them."""

    iteration: int
    kind: Literal["baseline", "implement", "repair", "tune", "human"]  # type: ignore[assignment]
    source_hash: str
    source_path: str
    stage: str = Field(description="'accepted' or the stage the harness stopped at")
    correct: bool = False
    compiled: bool = False
    uses_pallas: bool = False
    estimated_speedup: float | None = None
    estimated_speedup_by_generation: dict[str, float | None] = Field(
        default_factory=dict, description="every targeted generation's estimated speedup, the first included"
    )
    estimated_bound: str | None = Field(None, description="memory / compute / overhead, per the block model")
    measured_speedup: float | None = None

    def score(self) -> tuple[int, float]:
        """Higher is better: measured speedup when there is one, else the estimate (never mixed in one
        comparison: a measured candidate outranks any estimated one). With several target generations the
        estimate ranked by is their geometric mean (`ranking_speedup`)."""
        if self.measured_speedup is not None:
            return (SCORE_RANKS["measured"], self.measured_speedup)
        ranked = ranking_speedup(self.estimated_speedup, self.estimated_speedup_by_generation)
        if ranked is not None:
            return (SCORE_RANKS["estimated"], ranked)
        return (SCORE_RANKS["none"], 0.0)

    def score_text(self) -> str:
        """What the candidate is ranked by, said with its kind: 'measured 1.20x', 'estimated 1.25x geomean
        (v5e 1.79x, v6e 0.87x)', 'estimated 1.10x' or 'no perf figure'."""
        kind, value = self.score_kind(), self.score()[1]
        if kind == "none":
            return "no perf figure"
        gens = {g: v for g, v in self.estimated_speedup_by_generation.items() if v is not None}
        if kind == "estimated" and len(gens) >= 2:
            return f"estimated {value:.2f}x geomean ({self.estimate_text().removeprefix('estimated ')})"
        return f"{kind} {value:.2f}x"

    def estimate_text(self) -> str:
        """The estimated figures as a person reads them: each generation's, or the single one."""
        gens = {g: v for g, v in self.estimated_speedup_by_generation.items() if v is not None}
        if len(gens) >= 2:
            return "estimated " + ", ".join(f"{g} {v:.2f}x" for g, v in gens.items())
        return f"estimated {self.estimated_speedup:.2f}x" if self.estimated_speedup is not None else ""

    def score_kind(self) -> ScoreKind:
        return SCORE_KINDS[self.score()[0]]

    def line(self) -> str:
        perf = ""
        if self.measured_speedup is not None:
            perf = f", measured speedup {self.measured_speedup:.2f}x"
        elif self.estimated_speedup is not None:
            perf = f", {self.estimate_text().replace('estimated', 'estimated speedup', 1)}"
        cfg = f" config {self.config}" if self.config else ""
        verdict = "accepted" if self.accepted else f"failed at {self.stage}: {self.message[:300]}"
        return f"- round {self.iteration} {self.kind}{cfg} [{self.source_hash[:10]}]: {verdict}{perf}"


class HumanFeedback(BaseModel):
    at: str
    action: str
    text: str | None = None


class Conversion(BaseModel):
    """The `convert` subgraph's record: the file the run was given, and the JAX task it became."""

    source_path: str = Field(description="the file the run was given (PyTorch, CUDA or Triton)")
    kind: str = Field(description="pytorch | cuda | triton")
    task_dir: str | None = Field(None, description="the JAX problem dir written from it")
    verified: bool = Field(False, description="checked against the original on random inputs")
    message: str = ""
    writer: str = Field("", description="torchax (PyTorch) or the model that wrote the JAX reference")
    reviewed: bool = Field(False, description="a human approved (or edited) the JAX reference")
    attempts: int = Field(0, description="model-written references tried")


class AgentState(AgentInput):
    """Shared by every node: the input's fields plus what the nodes add. Lists with `operator.add` are
    appended to, never replaced."""

    # converted (PyTorch / CUDA / Triton given as the task)
    conversion: Conversion | None = None
    # prepared
    task: KernelTask | None = None
    run_dir: str | None = None
    budgets: Budgets = Field(default_factory=Budgets)
    usage: Usage = Field(default_factory=Usage)
    refused_features: list[str] = Field(
        default_factory=list,
        description="model features the provider rejected at call time in this thread ('tools', "
        "'structured_output'): the author uses the plain text protocol instead for the rest of the run",
    )
    # the current round
    iteration: int = 0
    plan: Plan | None = None
    source_hash: str | None = None
    source_path: str | None = None
    source_config: dict[str, Any] | None = Field(
        None, description="the author's config of the current source (None for a human edit or a baseline)"
    )
    attempt_kind: Literal["baseline", "implement", "repair", "tune", "human"] = "implement"
    repairs: int = 0
    improved: bool = Field(False, description="the best kernel improved during the current round")
    eval_result: EvalResult | None = Field(None, description="harness result of the current kernel")
    trace_summary: str | None = Field(
        None, description="profile/estimate summary (markdown) of the best kernel"
    )
    tuning: dict[str, Any] | None = Field(None, description="autotune outcome of this round")
    feedback: str | None = Field(None, description="feedback for the author's next step (human or harness)")
    tool_messages: Annotated[list[AnyMessage], add_messages] = Field(
        default_factory=list,
        description="the current implement/repair step's tool conversation: the model's tool-calling turns "
        "and the tool node's answers (checkpointed: a resumed run does not redo a tool call); cleared when "
        "the step ends",
    )
    tool_caller: Literal["implement", "repair"] | None = Field(
        None, description="the step the tool node returns to"
    )
    # across rounds
    attempts: Annotated[list[Attempt], operator.add] = Field(default_factory=list)
    human: Annotated[list[HumanFeedback], operator.add] = Field(default_factory=list)
    errors: Annotated[list[str], operator.add] = Field(default_factory=list)
    tried_strategies: Annotated[list[str], operator.add] = Field(default_factory=list)
    best: Attempt | None = None
    rounds_without_gain: int = 0
    stop_reason: str | None = None
    status: Literal["running", "succeeded", "failed", "stopped"] = "running"
    result_path: str | None = None


# --- search ------------------------------------------------------------------------------------------------

Algorithm = Literal["parallel", "beam"]


class SearchInput(BaseModel):
    task_path: str
    algorithm: Algorithm = "parallel"
    branches: int = Field(4, ge=1, description="parallel: branches; beam: children per expanded node")
    beam_width: int = Field(2, ge=1, description="beam: nodes kept per level")
    depth: int = Field(2, ge=1, description="beam: levels of expansion below the root")
    keep_factor: float = Field(1.0, gt=0, description="beam: a child survives if score >= factor x parent's")
    iterations: int = Field(1, ge=1, description="agent rounds per branch")
    tune_max_configs: int = Field(2, ge=0, description="autotune budget per branch round")
    strategies: list[str] | None = Field(None, description="strategies to draw from (default: the library)")
    scale: str | None = None
    out_dir: str | None = None

    def strategy_pool(self) -> list[str]:
        return list(self.strategies or strategy_names())


class SearchNode(BaseModel):
    id: str
    parent: str | None
    depth: int
    strategy: str | None
    accepted: bool = False
    source_path: str | None = None
    source_hash: str | None = None
    score_kind: ScoreKind = "none"
    score: float | None = Field(None, description="speedup of kind `score_kind` (measured or estimated)")
    score_text: str | None = Field(None, description="the score as a person reads it (`Attempt.score_text`)")
    kept: bool = False
    reason: str = ""
    result_path: str | None = None

    def rank(self) -> tuple[int, float]:
        return (SCORE_RANKS[self.score_kind] if self.accepted else -1, self.score or 0.0)


class BranchTask(BaseModel):
    """What `Send` hands one branch."""

    node_id: str
    parent: str | None
    depth: int
    strategy: str | None
    start_source_path: str | None = None
    search: SearchInput


class SearchState(SearchInput):
    nodes: Annotated[list[SearchNode], operator.add] = Field(default_factory=list)
    frontier: list[str] = Field(default_factory=list)
    level: int = 0
    best: SearchNode | None = None
    status: str = "running"
    result_path: str | None = None
