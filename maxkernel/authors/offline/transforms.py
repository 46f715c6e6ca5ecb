"""The offline author's transforms: which strategies of `maxkernel.strategies` it can apply, and how.

A round of the agent loop (or a search branch) names a strategy; the offline author turns it into a concrete
program variant it can render without the sandbox: a point of the tuning space chosen by the strategy's own
preference (`Strategy.prefers`), ties broken by the predicted time of `tuning.predicted_seconds`. A transform
*applies* to a run while it leads to a config that no attempt of the run has evaluated yet and that the
prediction does not rate hopeless; that is what lets the loop go on after round 1 and stop honestly when
nothing new is left ("every transform leads to a kernel already evaluated").

The table is the extension point: a new transform is one row. Order matters only as the fallback order when
the bound class of the best kernel names none of the applicable ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from maxkernel.authors.base import TileConfig
from maxkernel.authors.offline.spec import ProgramSpec
from maxkernel.authors.offline.tuning import predicted_seconds
from maxkernel.strategies import HOPELESS_FACTOR, get_strategy

Applies = Callable[[ProgramSpec], bool]


def _has_param(fragment: str) -> Applies:
    def check(program: ProgramSpec) -> bool:
        return any(fragment in p.name.lower() for k in program.kernels for p in k.params)

    return check


def _any_params(program: ProgramSpec) -> bool:
    return any(k.params for k in program.kernels)


@dataclass(frozen=True)
class Transform:
    """One strategy the offline author realises as a choice among its tuning space."""

    strategy: str
    applies: Applies
    why: str


TRANSFORMS: tuple[Transform, ...] = (
    Transform(
        "joint_block_search",
        _any_params,
        "the config the offline time model predicts fastest (HBM traffic, MXU, EUP, per-step overhead)",
    ),
    Transform("larger_tiles", _any_params, "the largest blocks that fit VMEM: fewer steps, fewer re-fetches"),
    Transform("full_k_panel", _has_param("_k"), "the largest contraction block: fewer accumulator passes"),
    Transform("mxu_shaped_tiles", _any_params, "blocks that are multiples of 256 (the v6e/7x MXU)"),
    Transform(
        "grid_order_reuse", _has_param("order"), "the grid order that keeps the larger operand resident"
    ),
    Transform("smaller_tiles", _any_params, "smaller blocks: more steps to overlap DMA with compute"),
)
"""Strategies the offline author can apply, with the reason the plan states."""

_BY_STRATEGY = {t.strategy: t for t in TRANSFORMS}


def transform_for(strategy: str | None) -> Transform | None:
    return _BY_STRATEGY.get(strategy or "")


def offline_strategies() -> list[str]:
    """Strategy names the offline author can apply (what a search should branch over offline)."""
    return [t.strategy for t in TRANSFORMS]


def ranked_space(
    program: ProgramSpec, space: list[TileConfig], tpu: list[str]
) -> list[tuple[TileConfig, float]]:
    """The space with each config's predicted time, hopeless configs (> HOPELESS_FACTOR x the best) removed,
    fastest first."""
    scored = [(c, predicted_seconds(program, c, tpu)) for c in space]
    if not scored:
        return []
    best = min(t for _, t in scored)
    kept = [(c, t) for c, t in scored if t <= best * HOPELESS_FACTOR]
    return sorted(kept, key=lambda ct: ct[1])


def pick(
    transform: Transform,
    program: ProgramSpec,
    space: list[TileConfig],
    tpu: list[str],
    tried: Iterable[TileConfig],
) -> TileConfig | None:
    """The config `transform` argues for among the untried, non-hopeless configs; None when none is left."""
    if not transform.applies(program):
        return None
    seen = set(tried)
    ranked = [(c, t) for c, t in ranked_space(program, space, tpu) if c not in seen]
    if not ranked:
        return None
    if transform.strategy == "joint_block_search":
        return ranked[0][0]
    prefers = get_strategy(transform.strategy).prefers
    if prefers is None:
        return ranked[0][0]
    # Highest preference; among equals, the fastest predicted (ranked is sorted by time, max keeps the first).
    best_pref = max(prefers(c.as_dict()) for c, _ in ranked)
    return next(c for c, _ in ranked if prefers(c.as_dict()) == best_pref)


def applicable(
    program: ProgramSpec, space: list[TileConfig], tpu: list[str], tried: Iterable[TileConfig]
) -> list[str]:
    """Strategies that still lead to a new config, in table order."""
    seen = set(tried)
    return [t.strategy for t in TRANSFORMS if pick(t, program, space, tpu, seen) is not None]
