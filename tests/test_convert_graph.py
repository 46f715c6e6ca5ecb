"""The `convert` subgraph before `prepare`: what each kind of file becomes, the model path with a scripted
model (a CUDA kernel's JAX reference, the loader's complaint fed back, a human review), and the checkpointed
resume of a paused conversion. PyTorch conversion itself is tested in test_convert_torch.py; here it is
replaced by a stand-in so the wiring is tested without PyTorch."""

from __future__ import annotations

from pathlib import Path

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from fake_chat import ScriptedChatModel
from maxkernel.context import Context
from maxkernel.convert.torch_task import ConversionResult
from maxkernel.graph.agent import compile_graph
from maxkernel.graph.convert import compile_convert_graph

DATA = Path(__file__).parent / "data"
CUDA = DATA / "cuda_add.cu"
EXAMPLE = Path(__file__).parents[1] / "examples" / "matmul_bias_relu"

GOOD_REFERENCE = """FRAMEWORK: cuda
```python
import jax
import jax.numpy as jnp


def get_inputs(scale="tpu", seed=0):
    n = 1 << 20 if scale == "tpu" else 4096
    ka, kb = jax.random.split(jax.random.key(seed))
    return [jax.random.normal(ka, (n,)), jax.random.normal(kb, (n,))], []


def computation(a, b):
    return jnp.maximum(a + b, 0.0)
```
Nothing left out.
"""
NO_INPUTS = """FRAMEWORK: cuda
```python
import jax.numpy as jnp


def computation(a, b):
    return jnp.maximum(a + b, 0.0)
```
"""


def context(tmp_path: Path, model: ScriptedChatModel | None = None) -> Context:
    return Context(
        model="scripted" if model else "offline", chat_model=model, tpu=["v5e"],
        store_path=str(tmp_path / "results.db"), work_dir=str(tmp_path / "work"), baseline=False,
    )  # fmt: skip


def test_cuda_kernel_gets_a_model_reference_fixed_from_feedback_and_reviewed(tmp_path: Path) -> None:
    model = ScriptedChatModel(replies=[NO_INPUTS, GOOD_REFERENCE])
    graph = compile_convert_graph(InMemorySaver())
    config = {"configurable": {"thread_id": "cu-1"}}
    ctx = context(tmp_path, model)
    graph.invoke({"task_path": str(CUDA), "mode": "hitl"}, config, context=ctx)
    paused = graph.get_state(config)
    (interrupt,) = [i for t in paused.tasks for i in t.interrupts]
    request = interrupt.value[0]
    assert request["kind"] == "conversion_review" and "jnp.maximum" in request["code"]
    assert request["verified"] is False and "NOT verified" in request["description"]
    assert "get_inputs" in str(model.prompts[1][-1].content)  # the loader's complaint went back to the model
    assert "__global__ void add_relu" in str(model.prompts[0][-1].content)
    graph.invoke(Command(resume={"action": "approve"}), config, context=ctx)
    state = graph.get_state(config).values
    conversion = state["conversion"]
    assert conversion.reviewed and conversion.attempts == 2 and conversion.kind == "cuda"
    assert (
        state["task_path"] == conversion.task_dir
        and (Path(conversion.task_dir) / "kernel_task.yaml").is_file()
    )


def test_auto_mode_does_not_pause_and_a_stop_ends_the_run(tmp_path: Path) -> None:
    graph = compile_convert_graph(InMemorySaver())
    ctx = context(tmp_path, ScriptedChatModel(replies=[GOOD_REFERENCE, GOOD_REFERENCE]))
    auto = graph.invoke(
        {"task_path": str(CUDA), "mode": "auto"}, {"configurable": {"thread_id": "a"}}, context=ctx
    )
    assert auto["conversion"].task_dir == auto["task_path"] and not auto["conversion"].reviewed
    config = {"configurable": {"thread_id": "b"}}
    graph.invoke({"task_path": str(CUDA), "mode": "hitl"}, config, context=ctx)
    stopped = graph.invoke(Command(resume=[{"type": "ignore", "args": None}]), config, context=ctx)
    assert stopped["status"] == "stopped" and stopped["stop_reason"] == "stopped at the conversion review"


def test_offline_author_refuses_a_cuda_kernel_by_name(tmp_path: Path) -> None:
    graph = compile_graph(InMemorySaver())
    state = graph.invoke({"task_path": str(CUDA), "out_dir": str(tmp_path / "out")},
                         {"configurable": {"thread_id": "off"}}, context=context(tmp_path))  # fmt: skip
    assert state["status"] == "failed" and state.get("task") is None
    assert (
        state["stop_reason"].startswith("bad task: cuda_add.cu is a cuda kernel")
        and "--model" in state["stop_reason"]
    )
    assert (tmp_path / "out" / "result.json").is_file()  # finalize still wrote the run's result


def test_pytorch_file_is_converted_before_prepare_and_not_again_on_resume(
    tmp_path: Path, monkeypatch
) -> None:
    calls: list[Path] = []

    def converted(path: Path, **_: object) -> ConversionResult:
        calls.append(Path(path))
        return ConversionResult(ok=True, source_path=str(path), task_dir=str(EXAMPLE), task_id="matmul_bias_relu",
                                versions={"torchax": "0.0.13"})  # fmt: skip

    monkeypatch.setattr("maxkernel.nodes.convert.convert_torch_file", converted)
    torch_file = DATA / "pytorch" / "mlp_block.py"
    graph = compile_convert_graph(InMemorySaver())
    config = {"configurable": {"thread_id": "pt"}}
    ctx = context(tmp_path)
    graph.invoke({"task_path": str(torch_file), "mode": "hitl"}, config, context=ctx)
    (interrupt,) = [i for t in graph.get_state(config).tasks for i in t.interrupts]
    assert interrupt.value[0]["verified"] is True and "def computation" in interrupt.value[0]["code"]
    graph.invoke(Command(resume={"action": "approve"}), config, context=ctx)
    state = graph.get_state(config).values
    assert state["task_path"] == str(EXAMPLE) and state["conversion"].writer == "torchax 0.0.13"
    assert calls == [torch_file]  # the resumed graph did not convert again


@pytest.mark.parametrize("bad", ["notes.txt"])
def test_a_file_of_no_known_kind_is_a_bad_task(tmp_path: Path, bad: str) -> None:
    (tmp_path / bad).write_text("hello\n")
    graph = compile_convert_graph(InMemorySaver())
    state = graph.invoke({"task_path": str(tmp_path / bad)}, {"configurable": {"thread_id": "x"}},
                         context=context(tmp_path))  # fmt: skip
    assert state["status"] == "failed" and "neither a task" in state["stop_reason"]


def test_a_conversion_review_is_answered_at_the_terminal_and_by_flags() -> None:
    from maxkernel.cli.terminal_review import REVIEW_FLAGS, interactive_review
    from maxkernel.nodes.review import answer

    replies = iter(["f", "accumulate in float32"])
    value = interactive_review({"kind": "conversion_review", "code": "def computation(a):\n    return a\n"},
                               ask=lambda _: next(replies))  # fmt: skip
    assert value == {"action": "feedback", "feedback": "accumulate in float32"}
    assert "--stop" in REVIEW_FLAGS["conversion_review"]
    assert answer("conversion_review", "code_file", "x = 1") == {"action": "edit", "code": "x = 1"}
