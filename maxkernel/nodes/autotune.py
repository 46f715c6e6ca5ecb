"""autotune (tool node): evaluate the author's tuning space around the accepted kernel and keep the best.

Configs are ranked by measured time on a device when there is one, otherwise by the TPU time estimate, and
the result says which. The winner is recorded in the store's tuning table per (kernel family, device kind,
bucketed argument shapes), and a config recorded there is the first one the next run tries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from langgraph.runtime import Runtime

from maxkernel.authors.base import AuthorError, TileConfig
from maxkernel.context import Context
from maxkernel.nodes.common import (
    author_context,
    author_for,
    current_plan,
    eval_slots,
    run_eval,
    save_source,
    store_at,
    to_attempt,
)
from maxkernel.nodes.finalize import write_best_so_far
from maxkernel.state import AgentState, Attempt
from maxkernel.strategies import HOPELESS_FACTOR, get_strategy, pick_config
from maxkernel.tools.cluster import bounded_map
from maxkernel.tools.tuning_table import TunedConfig, TuningKey, TuningTable, arg_spec, device_kind


def prune_hopeless(
    space: list[TileConfig], predicted: list[float] | None
) -> tuple[list[TileConfig], list[float] | None, int]:
    """Drop configs predicted hopeless; returns (kept, their predictions, how many were dropped)."""
    if not predicted or len(predicted) != len(space):
        return space, None, 0
    best = min(predicted)
    keep = [i for i, t in enumerate(predicted) if t <= best * HOPELESS_FACTOR]
    return [space[i] for i in keep], [predicted[i] for i in keep], len(space) - len(keep)


def _order(
    space: list[TileConfig],
    strategy: str | None,
    limit: int,
    predicted: list[float] | None = None,
    seed: TileConfig | None = None,
) -> list[TileConfig]:
    """Which configs to spend evaluations on: a config the tuning table recorded for this family and shape
    bucket first (when it is in the space); the strategy's favourite; then, with the author's predictions,
    where the prediction says time is saved (fastest predicted first). Without them: half the budget on the
    largest tiles (fewest grid steps and re-fetches — usually the best on TPUs, and the space is already
    pruned to what fits VMEM); the rest spread evenly over the space so the search explores."""
    if limit <= 0 or not space:
        return []
    chosen: list[TileConfig] = []

    def add(c: TileConfig) -> None:
        if c not in chosen and len(chosen) < limit:
            chosen.append(c)

    if seed is not None and seed in space:
        add(seed)
    if strategy:
        try:
            idx = pick_config(get_strategy(strategy), [c.as_dict() for c in space])
        except KeyError:
            idx = None
        if idx is not None:
            add(space[idx])
    if predicted is not None and len(predicted) == len(space):
        for i in sorted(range(len(space)), key=lambda i: predicted[i]):
            add(space[i])
        return chosen
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
    author = author_for(ctx, state.label)
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
    key = tuning_key(state, ctx)
    recorded = TuningTable(store_at(ctx.store_path)).get(key)
    seed = TileConfig.of(recorded.config) if recorded else None
    others = [c for c in space if c != start]
    predicted: list[float] | None = None
    predict = getattr(author, "predict_seconds", None)
    if callable(predict) and others:
        try:
            predicted = list(predict(actx, plan, others))
        except AuthorError:
            predicted = None
    others, predicted, hopeless = prune_hopeless(others, predicted)
    done = {TileConfig.of(a.config) for a in state.attempts if a.config}
    if predicted is not None:  # configs an earlier round evaluated are not evaluated again
        fresh = [i for i, c in enumerate(others) if c not in done]
        others, predicted = [others[i] for i in fresh], [predicted[i] for i in fresh]
    todo = _order(others, state.strategy, state.tune_max_configs + 1, predicted, seed)
    drafts: list[tuple[TileConfig, str, str, str]] = []  # (config, digest, path, source)
    for cfg in todo:
        if len(drafts) >= state.tune_max_configs:
            break
        try:
            draft = author.render(actx, plan, cfg)
        except AuthorError as exc:
            tried_note = f"render failed for {cfg.label()}: {exc}"
            return {"tuning": {"space_size": len(space), "evaluated": 0, "note": tried_note}}
        digest, path = save_source(state, draft.source)
        if digest == state.source_hash:
            continue  # the kernel we already have, at its own config
        drafts.append((cfg, digest, path, draft.source))
    # Configs are independent evaluations: on a Ray cluster they run at once, up to its capacity.
    results = bounded_map(lambda d: run_eval(state, ctx, d[3]), drafts, eval_slots(ctx), label="autotune")
    tried: list[Attempt] = [
        to_attempt(state, "tune", digest, path, result, config=cfg.as_dict())
        for (cfg, digest, path, _), result in zip(drafts, results, strict=True)
    ]
    pool = [a for a in ([current] if current else []) + tried if a.accepted]
    ranked = sorted(pool, key=lambda a: a.score(), reverse=True)
    winner = ranked[0] if ranked else current
    score_kind = winner.score_kind() if winner else "none"
    tuning = {
        "space_size": len(space),
        "evaluated": len(tried),
        "accepted": sum(a.accepted for a in tried),
        "winner_config": winner.config if winner else None,
        "winner_hash": winner.source_hash if winner else None,
        "ranked_by": score_kind,
        "seeded_from": recorded.config if recorded and seed in space else None,
        "skipped_hopeless": hopeless,
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
            if a.config:
                record_tuning(state, ctx, key, a)
            write_best_so_far(state, a)
    return update


def tuning_key(state: AgentState, ctx: Context) -> TuningKey:
    """What a tuned config is recorded under: the plan's kernel family, the device kind estimates were
    ranked on, and the task's bucketed argument shapes."""
    assert state.task is not None
    return TuningKey(
        family=current_plan(state).family or "unknown",
        device_kind=device_kind(list(ctx.tpu)),
        arg_spec=arg_spec(state.task.configs),
    )


def record_tuning(state: AgentState, ctx: Context, key: TuningKey, winner: Attempt) -> None:
    assert state.task is not None and winner.config
    TuningTable(store_at(ctx.store_path)).put(
        TunedConfig(
            **key.model_dump(),
            config=winner.config,
            score_kind=winner.score_kind(),
            score=winner.score()[1],
            task_id=state.task.task_id,
            source_hash=winner.source_hash,
        )
    )
