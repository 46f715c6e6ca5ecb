"""The offline author's loop: a different transform each round, reflect that stops only when nothing new is
left, the strategy pick from the bound class and what was tried, and an autotuner that skips hopeless configs.

One sandboxed analysis of a small matmul task (a few seconds); everything else is plain data."""

from __future__ import annotations

import pytest

from maxkernel.authors.base import Attempt, AuthorContext, TileConfig
from maxkernel.authors.offline import OfflineAuthor
from maxkernel.authors.offline.spec import ProgramSpec
from maxkernel.authors.offline.transforms import TRANSFORMS, applicable, pick, ranked_space
from maxkernel.authors.offline.tuning import predicted_seconds, tuning_space
from maxkernel.nodes.autotune import _order, prune_hopeless
from maxkernel.nodes.reflect import next_strategy
from maxkernel.state import AgentState
from maxkernel.state import Attempt as GraphAttempt
from maxkernel.strategies import HOPELESS_FACTOR, get_strategy
from maxkernel.tools.tasks import load_task
from tests.test_offline_author import CASES, TPU, make_task


@pytest.fixture(scope="module")
def analysed(tmp_path_factory: pytest.TempPathFactory) -> tuple[OfflineAuthor, AuthorContext, ProgramSpec]:
    root = tmp_path_factory.mktemp("loop")
    body, _, _ = CASES["matmul_f32_unaligned"]
    task = load_task(make_task(root, "loop_matmul", body), work_dir=root / "work")
    author = OfflineAuthor()
    ctx = AuthorContext(task=task, tpu=TPU, work_dir=root / "work")
    plan = author.plan(ctx)
    assert plan.supported, plan.unsupported_reason
    return author, ctx, ProgramSpec.model_validate(plan.data["program"])


def test_each_round_applies_a_different_transform(analysed) -> None:
    author, ctx, program = analysed
    default = author.plan(ctx).default_config
    tried: list[Attempt] = [Attempt(accepted=True, config=default.as_dict())]
    seen = {default}
    strategies = []
    for _ in range(4):
        decision = author.reflect(ctx, tried)
        assert decision.action == "continue", decision.reasons
        assert decision.strategies, "a continuing offline reflection names the transforms that apply"
        strategy = decision.strategies[0]
        plan = author.plan(ctx.model_copy(update={"strategy": strategy, "history": tried}))
        cfg = plan.default_config
        assert cfg not in seen, f"{strategy} repeated an evaluated config"
        assert any(strategy in h for h in plan.hints)
        seen.add(cfg)
        strategies.append(strategy)
        tried.append(Attempt(accepted=True, config=cfg.as_dict()))
    # once every non-hopeless config was evaluated, reflect stops and says why
    everything = [Attempt(accepted=True, config=c.as_dict()) for c in tuning_space(program, TPU)]
    stop = author.reflect(ctx, everything)
    assert stop.action == "stop" and "already evaluated" in stop.reasons[0]


def test_transforms_follow_their_strategy(analysed) -> None:
    _, _, program = analysed
    space = tuning_space(program, TPU)
    ranked = ranked_space(program, space, TPU)
    by = {t.strategy: t for t in TRANSFORMS}
    big = pick(by["larger_tiles"], program, space, TPU, [])
    small = pick(by["smaller_tiles"], program, space, TPU, [])
    fast = pick(by["joint_block_search"], program, space, TPU, [])
    prod = get_strategy("larger_tiles").prefers
    assert big is not None and small is not None and prod is not None
    assert prod(big.as_dict()) > prod(small.as_dict())
    assert fast == ranked[0][0]
    assert (
        predicted_seconds(program, fast, TPU)
        <= min(predicted_seconds(program, c, TPU) for c in space) * 1.0001
    )
    # nothing hopeless is offered, and a transform never returns a tried config
    best = ranked[0][1]
    assert all(t <= best * HOPELESS_FACTOR for _, t in ranked)
    assert pick(by["joint_block_search"], program, space, TPU, [fast]) != fast
    assert applicable(program, space, TPU, [c for c, _ in ranked]) == []


def test_prediction_rates_tiny_blocks_slower(analysed) -> None:
    _, _, program = analysed
    space = tuning_space(program, TPU)
    small = min(space, key=lambda c: get_strategy("larger_tiles").prefers(c.as_dict()))  # type: ignore[misc]
    large = max(space, key=lambda c: get_strategy("larger_tiles").prefers(c.as_dict()))  # type: ignore[misc]
    assert predicted_seconds(program, small, TPU) > predicted_seconds(program, large, TPU)


def test_autotune_skips_hopeless_and_spends_where_predicted() -> None:
    space = [TileConfig.of(block_m=v) for v in (8, 128, 256, 512)]
    predicted = [50.0, 2.0, 1.2, 1.0]
    kept, preds, dropped = prune_hopeless(space, predicted)
    assert dropped == 1 and TileConfig.of(block_m=8) not in kept
    order = _order(kept, None, 2, preds)
    assert order == [TileConfig.of(block_m=512), TileConfig.of(block_m=256)]
    # without predictions nothing is pruned
    assert prune_hopeless(space, None) == (space, None, 0)


def _state(bound: str, strategy: str | None, tried: list[str]) -> AgentState:
    best = GraphAttempt(
        iteration=1, kind="implement", source_hash="h", source_path="p", stage="accepted", accepted=True,
        estimated_speedup=0.8, estimated_bound=bound,
    )  # fmt: skip
    return AgentState(task_path="t", best=best, strategy=strategy, tried_strategies=tried)


def test_next_strategy_uses_bound_class_and_history() -> None:
    allowed = ["joint_block_search", "larger_tiles", "full_k_panel", "smaller_tiles"]
    assert next_strategy(_state("memory", None, []), allowed) == "larger_tiles"
    assert next_strategy(_state("memory", "larger_tiles", []), allowed) == "full_k_panel"
    assert next_strategy(_state("memory", "full_k_panel", ["larger_tiles"]), allowed) == "joint_block_search"
    # every allowed strategy tried: repeat the author's first choice (it picks an untried config)
    assert next_strategy(_state("compute", "smaller_tiles", allowed), allowed) == "joint_block_search"
    # an author with no opinion (the LLM author): the bound class alone
    assert next_strategy(_state("compute", None, []), None) == "mxu_shaped_tiles"


def test_strategy_block_rules_see_per_kernel_keys() -> None:
    prefers = get_strategy("larger_tiles").prefers
    assert prefers is not None
    assert prefers({"k1_block_m": 512, "k1_block_n": 256}) > prefers({"k1_block_m": 128, "k1_block_n": 256})
