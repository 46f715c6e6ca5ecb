"""autotune (tool node): evaluate the author's tuning space around the accepted kernel and keep the best.

Configs are ranked by measured time on a device when there is one, otherwise by the TPU time estimate, and
the result says which. The winner is recorded per (task, shapes, dtype, TPU generation) in the store.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from langgraph.runtime import Runtime

from maxkernel.authors.base import AuthorError, TileConfig
from maxkernel.graph.context import Context
from maxkernel.graph.state import AgentState, Attempt
from maxkernel.nodes.common import (
    author_context,
    author_for,
    current_plan,
    run_eval,
    save_source,
    store_at,
    to_attempt,
)
from maxkernel.nodes.finalize import write_best_so_far
from maxkernel.strategies import get_strategy, pick_config


def _order(space: list[TileConfig], strategy: str | None, limit: int) -> list[TileConfig]:
    """Which configs to spend evaluations on: the strategy's favourite first; then half the budget on the
    largest tiles (fewest grid steps and re-fetches — usually the best on TPUs, and the space is already
    pruned to what fits VMEM); the rest spread evenly over the space so the search still explores."""
    if limit <= 0 or not space:
        return []
    chosen: list[TileConfig] = []

    def add(c: TileConfig) -> None:
        if c not in chosen and len(chosen) < limit:
            chosen.append(c)

    if strategy:
        try:
            idx = pick_config(get_strategy(strategy), [c.as_dict() for c in space])
        except KeyError:
            idx = None
        if idx is not None:
            add(space[idx])
    largest = sorted(space, key=lambda c: _tile_product(c), reverse=True)
    for c in largest[: max(1, limit // 2)]:
        add(c)
    step = max(1, len(space) // max(1, limit - len(chosen)))
    for c in space[::step]:
        add(c)
    return chosen


def _tile_product(config: TileConfig) -> float:
    product = 1.0
    for _, value in config.params:
        if isinstance(value, int):
            product *= value
    return product


def autotune(state: AgentState, runtime: Runtime[Context]) -> dict[str, Any]:
    ctx = runtime.context
    author = author_for(ctx)
    assert state.source_path and state.source_hash and state.task
    plan = current_plan(state)
    plan = plan.model_copy(update={"data": {**plan.data, "source": Path(state.source_path).read_text()}})
    actx = author_context(state, ctx)
    try:
        space = author.tuning_space(actx, plan)
    except AuthorError as exc:
        return {
            "tuning": {"space_size": 0, "evaluated": 0, "note": f"no tuning space: {exc}"},
            "improved": state.improved,
        }
    current = next((a for a in reversed(state.attempts) if a.source_hash == state.source_hash), None)
    start = plan.default_config
    todo = _order([c for c in space if c != start], state.strategy, state.budgets.tune_max_configs + 1)
    tried: list[Attempt] = []
    for cfg in todo:
        if len(tried) >= state.budgets.tune_max_configs:
            break
        try:
            draft = author.render(actx, plan, cfg)
        except AuthorError as exc:
            tried_note = f"render failed for {cfg.label()}: {exc}"
            return {"tuning": {"space_size": len(space), "evaluated": len(tried), "note": tried_note}}
        digest, path = save_source(state, draft.source)
        if digest == state.source_hash:
            continue  # the kernel we already have, at its own config
        result = run_eval(state, ctx, draft.source)
        tried.append(to_attempt(state, "tune", digest, path, result, config=cfg.as_dict()))
    pool = [a for a in ([current] if current else []) + tried if a.accepted]
    ranked = sorted(pool, key=lambda a: a.score(), reverse=True)
    winner = ranked[0] if ranked else current
    score_kind = {2: "measured", 1: "estimated", 0: "none"}[winner.score()[0]] if winner else "none"
    tuning = {
        "space_size": len(space),
        "evaluated": len(tried),
        "accepted": sum(a.accepted for a in tried),
        "winner_config": winner.config if winner else None,
        "winner_hash": winner.source_hash if winner else None,
        "ranked_by": score_kind,
        "note": ""
        if score_kind != "none"
        else "no measurement or estimate to rank configs: kept the first kernel",
    }
    update: dict[str, Any] = {"attempts": tried, "tuning": tuning}
    if winner and current and winner.source_hash != current.source_hash and winner.score() > current.score():
        update["source_hash"], update["source_path"] = winner.source_hash, winner.source_path
    best = state.best
    for a in ranked[:1]:
        if best is None or a.score() > best.score():
            update["best"], update["improved"] = a, True
            record_tuning(state, ctx, a, score_kind)
            write_best_so_far(state, a)
    return update


def record_tuning(state: AgentState, ctx: Context, winner: Attempt, score_kind: str) -> None:
    task = state.task
    assert task is not None
    shapes = ";".join(",".join(f"{a.dtype}{list(a.shape)}" for a in c.dynamic) for c in task.configs)
    store_at(ctx.store_path).put_tuning(
        task_id=task.task_id,
        shapes=shapes,
        generations=",".join(ctx.tpu),
        config=winner.config or {},
        source_hash=winner.source_hash,
        score_kind=score_kind,
        score=winner.score()[1],
    )
