"""The one reply parser on the reply shapes providers really send (tests/fake_chat.py builds them)."""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import AIMessage

from fake_chat import (
    KERNEL,
    anthropic_message,
    gemini3_message,
    openai_message,
    openai_reasoning_message,
)
from maxkernel.authors.llm import ReflectionReply, parse_decision
from maxkernel.authors.reply import NoModule, extract_json_object, extract_module, parse_message
from maxkernel.authors.tuning_space import declared_tuning_space

SNIPPET = "x = jnp.ones((8, 128))\n"


@pytest.mark.parametrize(
    "message",
    [
        gemini3_message("Here is the kernel.\n```python\n" + KERNEL + "```\n"),
        anthropic_message("I'll write it.\n\n```python\n" + KERNEL + "```\nDone."),
        openai_message("```python\n" + KERNEL + "```"),
        openai_reasoning_message("```py\n" + KERNEL + "```"),
    ],
    ids=["gemini3", "anthropic", "openai", "openai-reasoning"],
)
def test_provider_shapes_give_the_module_and_never_the_thinking(message: AIMessage) -> None:
    parsed = parse_message(message)
    assert "THOUGHT" not in parsed.text  # thinking blocks never reach the code parser
    assert extract_module(parsed.text) == KERNEL
    assert not parsed.truncated and parsed.total_tokens and parsed.total_tokens > 0


def test_gemini_thinking_is_kept_apart_with_its_signature_ignored() -> None:
    parsed = parse_message(gemini3_message("ok"))
    assert parsed.text == "ok" and "THOUGHT" in parsed.thinking


@pytest.mark.parametrize(
    "fence",
    ["```python", "```Python", "```python3", "```py", "```", "~~~python", "~~~", "````python"],
)
def test_every_fence_style(fence: str) -> None:
    closer = fence[:3] if fence[3:4] != fence[0] else fence[:4]
    text = f"Some prose.\n{fence}\n{KERNEL}{closer}\nMore prose."
    assert extract_module(text) == KERNEL


def test_unfenced_module_with_prose_around_it() -> None:
    text = "Sure! Here is the kernel:\n\n" + KERNEL + "\nThis tiles the matmul; let me know."
    assert extract_module(text) == KERNEL


def test_several_blocks_pick_the_module_that_defines_computation_and_calls_pallas() -> None:
    plain = "import jax.numpy as jnp\n\ndef computation(x, w, b):\n    return jnp.maximum(x @ w + b, 0)\n"
    text = (
        "The reference is:\n```python\n" + plain + "```\nA helper:\n```python\n" + SNIPPET + "```\n"
        "The kernel:\n```python\n" + KERNEL + "```\nUsage:\n```bash\npython run.py\n```\n"
    )
    assert extract_module(text) == KERNEL


def test_a_truncated_block_loses_to_a_closed_one_and_is_flagged_when_alone() -> None:
    text = "```python\n" + KERNEL + "```\nAnd a variant:\n```python\n" + KERNEL
    assert extract_module(text) == KERNEL
    with pytest.raises(NoModule):
        extract_module("```python\n" + SNIPPET + "```")
    with pytest.raises(NoModule, match="no code"):
        extract_module("I think a tiled matmul would work well here.")


@pytest.mark.parametrize(
    ("meta", "truncated"),
    [
        ({"finish_reason": "MAX_TOKENS"}, True),  # Gemini
        ({"stop_reason": "max_tokens"}, True),  # Anthropic
        ({"finish_reason": "length"}, True),  # OpenAI
        ({"finish_reason": "STOP"}, False),
        ({"finish_reason": "stop"}, False),
    ],
)
def test_truncation_by_every_provider_spelling(meta: dict, truncated: bool) -> None:
    assert (
        parse_message(AIMessage(content="```python\nimport jax\n", response_metadata=meta)).truncated
        is truncated
    )


def test_thinking_only_reply() -> None:
    msg = AIMessage(content=[{"type": "thinking", "thinking": "THOUGHT: hmm", "signature": "c2ln"}])
    assert parse_message(msg).thinking_only


@pytest.mark.parametrize(
    "text",
    [
        '{"decision": "stop", "reason": "fast enough", "next_strategy": null, "hint": null}',
        'My analysis...\n```json\n{"decision": "stop", "reason": "fast enough"}\n```',
        'Decision below {"decision": "Stop", "reason": "fast {enough}", "hint": "a \\"quoted\\" hint"} done',
        "**Decision:** stop\n**Reason:** fast enough",
    ],
)
def test_reflection_decisions_from_free_text(text: str) -> None:
    reply = parse_decision(text, ReflectionReply)
    assert isinstance(reply, ReflectionReply) and reply.decision == "stop"


def test_continue_with_a_strategy_from_keyword_text() -> None:
    reply = parse_decision("decision: continue\nnext_strategy: larger_tiles\nhint: bigger M", ReflectionReply)
    assert reply.decision == "continue" and reply.next_strategy == "larger_tiles"


def test_json_object_with_nested_braces() -> None:
    raw = extract_json_object('x {"a": {"b": "}"}, "c": 1} y')
    assert raw is not None and json.loads(raw) == {"a": {"b": "}"}, "c": 1}


def test_declared_tuning_space_is_read_without_running_the_module() -> None:
    src = 'import os\nos.system("false")\nBLOCK_M = 128\nTUNING_SPACE = {"BLOCK_M": [128, 256], "ORDER": ("mn", "nm")}\n'
    assert declared_tuning_space(src) == {"BLOCK_M": [128, 256], "ORDER": ["mn", "nm"]}
    assert declared_tuning_space("BLOCK_M = 128\n") is None
    assert declared_tuning_space("TUNING_SPACE = make_space()\n") is None
