"""The strategy library and the prompt templates: sizes, rendering, and what reaches a model."""

from __future__ import annotations

from pathlib import Path

import pytest

from fake_chat import ScriptedChatModel
from maxkernel.authors.base import AuthorContext, AuthorError, Plan, TileConfig
from maxkernel.authors.llm import LLMAuthor, extract_code
from maxkernel.prompts import render, system_prompt
from maxkernel.strategies import STRATEGIES, get_strategy, pick_config, strategy_names
from maxkernel.tools.results import ArraySpec, InputConfig
from maxkernel.tools.tasks import KernelTask

REF = Path(__file__).parent / "data" / "tasks" / "small_matmul" / "reference.py"


def test_library_has_thirty_distinct_strategies_in_every_category() -> None:
    assert len(STRATEGIES) >= 30
    assert len(set(strategy_names())) == len(STRATEGIES)
    assert {s.category for s in STRATEGIES} == {"data movement", "layout", "compute", "tuning"}
    for s in STRATEGIES:
        assert len(s.guidance) > 60 and s.title in s.render()
    with pytest.raises(KeyError, match="unknown strategy"):
        get_strategy("nope")


def test_strategy_preferences_pick_concrete_configs() -> None:
    configs = [
        {"block_m": 128, "block_n": 128},
        {"block_m": 512, "block_n": 256},
        {"block_m": 256, "block_n": 256},
    ]
    assert pick_config(get_strategy("larger_tiles"), configs) == 1
    assert pick_config(get_strategy("smaller_tiles"), configs) == 0
    assert pick_config(get_strategy("fuse_epilogue"), configs) is None  # guidance only


def test_templates_render_and_the_guide_reaches_the_system_prompt() -> None:
    text = system_prompt(["v5e", "v6e"])
    assert "v5e, v6e" in text and "(8, 128)" in text and "dimension_semantics" in text
    with pytest.raises(KeyError):
        render("plan", task_id="x")  # every placeholder must be given


def _task() -> KernelTask:
    cfg = InputConfig(
        dynamic=[ArraySpec(shape=(128, 256), dtype="float32")],
        outputs=[ArraySpec(shape=(128, 256), dtype="float32")],
        atol=1e-3,
        rtol=1e-3,
    )
    return KernelTask(
        task_id="t", format="reference", path=str(REF.parent), reference_path=str(REF), fingerprint="f",
        configs=[cfg], validation_configs=[cfg], validation_mode="task",
    )  # fmt: skip


def test_llm_author_prompts_carry_reference_strategy_and_failure() -> None:
    model = ScriptedChatModel(
        replies=["# plan", "```python\ndef computation(x):\n    return x\n```", "no code", "still none"]
    )
    author = LLMAuthor(model, model_name="scripted")
    ctx = AuthorContext(task=_task(), tpu=["v5e"], strategy="larger_tiles")
    plan = author.plan(ctx)
    prompt = model.prompts[0][-1].content
    assert "def computation(x, w, b)" in prompt and "Grow the tiles" in prompt
    assert "float32[128,256]" in prompt
    draft = author.repair(ctx, plan, "def computation(x): ...", "compile: RESOURCE_EXHAUSTED scoped vmem", [])
    assert (
        "RESOURCE_EXHAUSTED" in model.prompts[1][-1].content
        and "Stage: compile" in model.prompts[1][-1].content
    )
    assert draft.source.startswith("def computation")
    with pytest.raises(AuthorError, match="unusable twice: the reply has no code"):
        author.implement(ctx, plan)  # a code-less reply is re-asked once, then given up
    assert "the reply has no code" in model.prompts[3][-1].content
    assert author.usage.model_calls == 4 and author.usage.reasked_calls == 1 and author.usage.tokens > 0


def test_llm_tuning_space_is_the_declared_one_and_renders() -> None:
    source = (
        'BLOCK_M = 128\nBLOCK_K = 256\nTUNING_SPACE = {"BLOCK_M": [128, 256], "BLOCK_K": [256, 512]}\n\n'
        "def computation(x):\n    return x\n"
    )
    author = LLMAuthor(ScriptedChatModel(replies=[]), model_name="scripted")
    plan = Plan(family="llm", summary="s", text="t", data={"source": source})
    ctx = AuthorContext(task=_task())
    space = author.tuning_space(ctx, plan)
    assert set(space) == {TileConfig.of(BLOCK_M=m, BLOCK_K=k) for m in (128, 256) for k in (256, 512)}
    draft = author.render(ctx, plan, TileConfig.of(BLOCK_M=256, BLOCK_K=512))
    assert "BLOCK_M = 256" in draft.source and "BLOCK_K = 512" in draft.source
    undeclared = plan.model_copy(update={"data": {"source": "BLOCK_M = 128\n"}})
    assert author.tuning_space(ctx, undeclared) == []  # no declaration, no guessing


def test_extract_code_prefers_the_block_with_computation() -> None:
    text = "```python\nx = 1\n```\nthen\n```python\ndef computation(a):\n    return a\n```"
    assert extract_code(text).startswith("def computation")
