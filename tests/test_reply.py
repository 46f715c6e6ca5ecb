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
from maxkernel.authors.reply import (
    NoModule,
    code_blocks,
    extract_json_object,
    extract_module,
    fenced,
    missing_names,
    parse_message,
)
from maxkernel.authors.tuning_space import declared_tuning_space, set_constants, settable_constants

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


HEAD, TAIL = KERNEL.split("def computation")
TAIL = "def computation" + TAIL


def test_a_kernel_split_over_two_blocks_is_assembled() -> None:
    assert missing_names(TAIL) >= {"pl", "jax", "_kernel", "BLOCK_M"} and not missing_names(KERNEL)
    text = (
        "First the imports, constants and the kernel body:\n```python\n" + HEAD + "```\n"
        "Then the wrapper:\n```python\n" + TAIL + "```\n"
        "Call it like this:\n```python\nout = computation(x, w, b)\nprint(out)\n```\n"
    )
    module = extract_module(text)
    assert module.rstrip() == (HEAD.rstrip() + "\n\n" + TAIL).rstrip()  # usage example left out
    assert not missing_names(module)
    compile(module, "kernel.py", "exec")


def test_a_complete_block_is_taken_alone_and_an_assembly_must_help() -> None:
    text = "```python\n" + HEAD + "```\n```python\n" + KERNEL + "```\n"
    assert extract_module(text) == KERNEL  # complete: nothing pasted in front of it
    lonely = "```python\n" + SNIPPET + "```\n```python\n" + TAIL + "```\n"
    assert extract_module(lonely) == TAIL  # the other block does not supply what it lacks: left as it is


@pytest.mark.parametrize(
    "code",
    ['"""Usage:\n```python\nf(x)\n```\n"""\nx = 1\n', "s = '````'\n", "plain = 1\n", "a = '`'\n"],
)
def test_fenced_code_survives_its_own_backticks(code: str) -> None:
    (block,) = code_blocks("Review this:\n\n" + fenced(code, "python") + "\n\nThanks.")
    assert block.code == code and block.info == "python" and block.closed


def test_tuned_constants_are_set_in_every_form_people_write() -> None:
    src = (
        "import jax\n"
        "BLOCK_M, BLOCK_N = 128, 256  # tiles\n"
        "(BLOCK_K, ORDER) = (512, 'mn')\n"
        "STAGES: int = 2\n"
        "DERIVED = BLOCK_M * 2\n"
        "def f():\n    BLOCK_M = 1\n    return BLOCK_M\n"
    )
    assert settable_constants(src) == {"BLOCK_M", "BLOCK_N", "BLOCK_K", "ORDER", "STAGES"}
    out = set_constants(src, {"BLOCK_M": 256, "BLOCK_N": 128, "ORDER": "nm", "STAGES": 3, "BLOCK_K": 1024})
    assert out.splitlines()[1:4] == [
        "BLOCK_M, BLOCK_N = 256, 128  # tiles",
        "(BLOCK_K, ORDER) = (1024, 'nm')",
        "STAGES: int = 3",
    ]
    assert out.splitlines()[4:] == src.splitlines()[4:]  # a derived constant and a local are not touched
    with pytest.raises(KeyError, match="DERIVED"):
        set_constants(src, {"DERIVED": 4})
    # Offsets are bytes in `ast`: text before a constant on its line with non-ASCII characters still lines up.
    assert set_constants("π = 3  # ½\nB = 1\n", {"B": 2}) == "π = 3  # ½\nB = 2\n"
    assert set_constants("A, π = 1, 2\n", {"A": 5}) == "A, π = 5, 2\n"
