"""What every author implements: the contract between the agent graph and whatever writes kernels.

An author turns a task into a plan, a plan into kernel source, a failure into a repaired source, and a plan
into a tuning space whose points it can render as source again. Two authors exist: `OfflineAuthor`
(deterministic, from the reference's jaxpr, no model) and the LLM author. Both speak only the models below,
so the graph can run, checkpoint and test either one without knowing which it has.

Authors never evaluate kernels and never run task code in their own process: evaluation belongs to the
harness (`maxkernel.tools.harness`), and anything that must execute the reference runs in the sandbox.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from maxkernel.tools.tasks import KernelTask
from maxkernel.tools.tpu_specs import DEFAULT_GENERATIONS

ParamValue = int | str


class AuthorError(Exception):
    """The author could not produce what was asked (no plan, nothing left to repair). Not a kernel failure."""


class BudgetSpent(Exception):
    """A run budget does not allow the next model call. The message names the budget; the graph stops the
    run with it as the reason (never a retry, never "the model produced nothing, carry on")."""


class RunBudget(BaseModel):
    """A run's model budgets and what it had spent when the step began, so an author can check them before
    every call it makes (a plan, a re-ask, a retry), not only between steps. The graph's own checks
    (`nodes.common.budget_exhausted`) read the same rules, so both name a spent budget the same way."""

    max_model_calls: int | None = Field(None, description="calls at most, failed and re-asked ones included")
    max_tokens: int | None = Field(None, description="tokens at most, as the provider reports them")
    max_wall_s: float | None = Field(None, description="seconds at most since `started_at`")
    started_at: float = Field(0.0, description="time.time() when the run began (0: unknown, no wall limit)")
    calls: int = Field(0, description="model calls the run had made when the step began")
    tokens: int = Field(0, description="tokens the run had spent when the step began")

    def spent(self, calls: int, tokens: int, now: float, next_prompt_tokens: int = 0) -> str | None:
        """The budget that forbids another call after `calls` and `tokens` (None: a call may be made).
        `next_prompt_tokens` (estimated) refuses a call whose prompt alone would not fit in the tokens left:
        such a call would overshoot the budget before its reply arrived."""
        if self.max_model_calls is not None and calls >= self.max_model_calls:
            return f"model-call budget spent ({calls}/{self.max_model_calls})"
        if self.max_tokens is not None:
            if tokens >= self.max_tokens:
                return f"token budget spent ({tokens}/{self.max_tokens})"
            if tokens + next_prompt_tokens > self.max_tokens:
                return (
                    f"token budget: the next call's prompt (~{next_prompt_tokens} tokens, estimated) does not "
                    f"fit in the {self.max_tokens - tokens} left ({tokens}/{self.max_tokens} spent)"
                )
        left = self.wall_left(now)
        if left is not None and left <= 0:
            return self.wall_reason()
        return None

    def wall_left(self, now: float) -> float | None:
        """Seconds left on the wall-clock budget (None: none set)."""
        if self.max_wall_s is None or not self.started_at:
            return None
        return self.started_at + self.max_wall_s - now

    def wall_reason(self) -> str:
        return f"wall-time budget spent ({self.max_wall_s:.0f} s)"


class AuthorContext(BaseModel):
    """What an author may look at for one call. Small on purpose: state lives in the graph, not here."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    task: KernelTask
    tpu: list[str] = Field(
        default_factory=lambda: list(DEFAULT_GENERATIONS), description="TPU generations targeted"
    )
    work_dir: Path = Field(Path(".maxkernel"), description="where sandbox run directories go")
    feedback: str = Field("", description="human or harness feedback the next step should take into account")
    starting_source: str | None = Field(None, description="a correct kernel to improve on, when one exists")
    strategy: str | None = Field(None, description="the optimisation strategy this round should apply")
    history: list[Attempt] = Field(default_factory=list, description="earlier attempts in this run")
    profile: str | None = Field(None, description="trace summary / estimates of the best kernel (markdown)")
    plan_text: str | None = Field(None, description="the current round's plan (reflect and repair read it)")
    tried_strategies: list[str] = Field(default_factory=list, description="strategies this run applied")
    tool_messages: list[Any] = Field(
        default_factory=list,
        description="this step's conversation after its prompt: the model's tool-calling turns and the tool "
        "node's answers (LangChain messages, from the checkpointed state)",
    )
    tools_left: int = Field(
        0,
        description="tool calls this step may still ask for; 0 (a caller with no tool node): answer without",
    )
    usage_key: str = Field(
        "", description="the run (thread/branch) model usage is charged to in the store; empty: not recorded"
    )
    budget: RunBudget | None = Field(
        None, description="the run's model budgets, checked before every model call; None: unlimited"
    )
    refused: list[str] = Field(
        default_factory=list,
        description="model features the provider refused at call time in this thread ('tools', "
        "'structured_output'): the plain text protocol is used instead",
    )
    scope: str = Field(
        "",
        description="where in a run this call happens (thread/round/step); identical scope+prompt = same call",
    )


class TileConfig(BaseModel):
    """One point of a tuning space: named parameters (block sizes, grid order, ...).

    Frozen and hashable so a space is a set and a config can key a results table. Parameters are kept
    sorted by name, so two configs with the same values are equal however they were built.
    """

    model_config = ConfigDict(frozen=True)

    params: tuple[tuple[str, ParamValue], ...]

    @field_validator("params")
    @classmethod
    def _valid(cls, params: tuple[tuple[str, ParamValue], ...]) -> tuple[tuple[str, ParamValue], ...]:
        names = [n for n, _ in params]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate parameter names in {names}")
        for name, value in params:
            if not name or not name.replace("_", "").replace(".", "").isalnum():
                raise ValueError(f"bad parameter name {name!r}")
            if isinstance(value, bool) or (isinstance(value, int) and value <= 0):
                raise ValueError(f"parameter {name} must be a positive int or a string, got {value!r}")
        return tuple(sorted(params))

    @classmethod
    def of(cls, values: dict[str, ParamValue] | None = None, **kw: ParamValue) -> TileConfig:
        merged = {**(values or {}), **kw}
        return cls(params=tuple(merged.items()))

    def as_dict(self) -> dict[str, ParamValue]:
        return dict(self.params)

    def get(self, name: str, default: ParamValue | None = None) -> ParamValue | None:
        return self.as_dict().get(name, default)

    def replace(self, **kw: ParamValue) -> TileConfig:
        return TileConfig.of(self.as_dict(), **kw)

    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.params) or "(defaults)"


class Plan(BaseModel):
    """What the author intends to write. `text` is for people (and for a model to follow); `data` is the
    author's own structured material (the offline author keeps its jaxpr analysis there), opaque to the
    graph but serialisable so a checkpointed run can resume."""

    family: str = Field(description="what kind of computation this is, e.g. 'matmul', 'attention'")
    summary: str = Field(description="one line")
    text: str = Field(description="the plan in markdown: computation, kernel structure, tiling, tuning")
    supported: bool = Field(True, description="False when the author cannot write a kernel for this task")
    unsupported_reason: str | None = None
    default_config: TileConfig | None = None
    hints: list[str] = Field(default_factory=list, description="guidance folded in (reflection, humans)")
    strategy: str | None = Field(
        None,
        description="the ONE strategy this plan applies: the round's when it had one, else the author's "
        "own choice (which the plan node then records as the round's)",
    )
    data: dict[str, Any] = Field(default_factory=dict)


class Draft(BaseModel):
    """Kernel source the harness can evaluate, with the author's notes about it."""

    source: str
    notes: str = ""
    config: TileConfig | None = None
    plan_update: Plan | None = Field(
        None,
        description="set when the author switched plans to write this draft (e.g. a repair that fuses less)",
    )


class ToolRequest(BaseModel):
    """An implement/repair step that cannot answer yet: the model asked for tools. The graph's tool node
    runs them (in the sandbox, for a draft check) and calls the step again with `AuthorContext.tool_messages`
    extended by this message and the tools' answers."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    message: Any = Field(description="the model's reply (an AIMessage whose tool_calls are to be run)")


class Attempt(BaseModel):
    """One evaluated kernel as an author sees it. The graph's record (`maxkernel.state.Attempt`) extends this
    class, so the graph hands its own attempts to an author as they are."""

    model_config = ConfigDict(extra="ignore")

    source_hash: str = ""
    kind: str = ""
    stage: str = Field("", description="'accepted' or the stage the harness stopped at")
    message: str = ""
    accepted: bool = False
    config: dict[str, Any] | None = None
    estimated_seconds: float | None = None
    measured_seconds: float | None = None


class Reflection(BaseModel):
    """After a round: go on with a new plan hint, or stop, and why."""

    action: Literal["continue", "stop"]
    reasons: list[str] = Field(default_factory=list)
    plan_hint: str | None = Field(None, description="what the next plan should change (when continuing)")
    next_strategy: str | None = Field(
        None, description="the ONE strategy the next round applies, when the author chose one (wins)"
    )
    strategies: list[str] = Field(
        default_factory=list,
        description="strategies the author can still apply, best first (empty: no preference / any)",
    )


@runtime_checkable
class Author(Protocol):
    """The methods the agent graph calls. Each is one step; none evaluates anything."""

    name: str

    def plan(self, ctx: AuthorContext) -> Plan:
        """Analyse the task and say what kernel to write (or that none can be written, and why)."""
        ...

    def implement(self, ctx: AuthorContext, plan: Plan) -> Draft | ToolRequest:
        """Write the kernel the plan describes, at the plan's default config (or, when `ctx.tools_left`,
        ask for tools first)."""
        ...

    def repair(
        self, ctx: AuthorContext, plan: Plan, source: str, failure: str, history: list[Attempt]
    ) -> Draft | ToolRequest:
        """Write a new source that avoids `failure` (the harness's stage and message), or ask for tools
        first. Raises `AuthorError` when the author has nothing left to try."""
        ...

    def tuning_space(self, ctx: AuthorContext, plan: Plan) -> list[TileConfig]:
        """Valid configs for the plan's kernel(s): aligned for the dtypes and within VMEM on every target."""
        ...

    def render(self, ctx: AuthorContext, plan: Plan, config: TileConfig) -> Draft:
        """The same kernel with another config."""
        ...

    def reflect(self, ctx: AuthorContext, history: list[Attempt]) -> Reflection:
        """Decide whether another round is worth it."""
        ...


AuthorContext.model_rebuild()
