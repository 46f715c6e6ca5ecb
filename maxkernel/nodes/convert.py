"""The `convert` subgraph's nodes: a PyTorch, CUDA or Triton file given as the task becomes a JAX task.

`convert_source` says what the file is (read as text) and converts it: PyTorch through torchax in a
sandboxed child (`maxkernel.convert.convert_torch_file`, verified against PyTorch); CUDA or Triton through
the run's model (`LLMAuthor.write_reference`), checked for loading as a task, with the loader's message fed
back to the model up to `MODEL_REFERENCE_TRIES` times. `review_conversion` (hitl) shows the JAX reference
and takes approve / edit / feedback / stop. Both are idempotent on re-execution: a conversion is cached
by file content (PyTorch) or kept in the state (the model's), so a resumed run does not redo it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from langgraph.runtime import Runtime

from maxkernel.authors.base import AuthorError
from maxkernel.context import Context
from maxkernel.convert import convert_torch_file, source_kind
from maxkernel.convert.model_task import UNVERIFIABLE, check_loads, model_task_dir, write_model_task
from maxkernel.nodes.common import author_for
from maxkernel.nodes.review import ask
from maxkernel.state import AgentState, Conversion

MODEL_REFERENCE_TRIES = 3


def _refused(conversion: Conversion | None, message: str) -> dict[str, Any]:
    return {"status": "failed", "stop_reason": f"bad task: {message}", "errors": [message],
            "conversion": conversion}  # fmt: skip


def convert_source(state: AgentState, runtime: Runtime[Context]) -> dict[str, Any]:
    ctx = runtime.context
    done = state.conversion
    if done is not None and done.task_dir and Path(state.task_path) == Path(done.task_dir):
        return {}  # converted before a resume: the task path already points at the JAX task
    path = Path(state.task_path)
    kind = source_kind(path)
    if kind == "task":
        return {}
    if not path.exists():
        return _refused(None, f"{path} not found")
    if kind == "unknown":
        return _refused(None, f"{path} is neither a task, a PyTorch file, nor a CUDA/Triton kernel")
    if kind == "pytorch":
        result = convert_torch_file(path, work_dir=ctx.work_dir)
        conversion = Conversion(
            source_path=str(path), kind=kind, task_dir=result.task_dir, verified=result.ok,
            message=result.message(), writer="torchax " + result.versions.get("torchax", ""),
        )  # fmt: skip
        if not result.ok:
            return _refused(conversion, result.message())
        return {"task_path": result.task_dir, "conversion": conversion}
    return _model_reference(state, ctx, path, kind, feedback=state.feedback or "")


def _model_reference(state: AgentState, ctx: Context, path: Path, kind: str, feedback: str) -> dict[str, Any]:
    if ctx.is_offline:
        return _refused(None, f"{path.name} is a {kind} kernel: writing its JAX reference needs a model "
                        "(--model PROVIDER:MODEL); the offline author reads JAX only")  # fmt: skip
    author = author_for(ctx)
    if not hasattr(author, "write_reference"):
        return _refused(None, f"the author {type(author).__name__} cannot write a JAX reference")
    source = path.read_text(errors="replace")
    previous = state.conversion.attempts if state.conversion else 0
    work = Path(ctx.work_dir).resolve()
    problem = ""
    for attempt in range(previous + 1, previous + 1 + MODEL_REFERENCE_TRIES):
        hint = "\n\n".join(x for x in (feedback, problem) if x)
        try:
            framework, module = author.write_reference(source, path.name, hint, key=f"convert:{path}")
        except AuthorError as exc:
            problem = f"Your reply had no usable module: {exc}"
            continue
        dest = write_model_task(path, module, framework if framework != "unknown" else kind,
                                model_task_dir(path, work, attempt), author.name)  # fmt: skip
        error = check_loads(dest, work)
        if error is None:
            conversion = Conversion(
                source_path=str(path), kind=kind, task_dir=str(dest), verified=False,
                message=UNVERIFIABLE.get(kind, ""), writer=author.name, attempts=attempt,
            )  # fmt: skip
            return {"task_path": str(dest), "conversion": conversion, "feedback": None}
        problem = f"Your previous reference failed to load as a task: {error}"
    conversion = Conversion(source_path=str(path), kind=kind, attempts=previous + MODEL_REFERENCE_TRIES,
                            message=problem, writer=author.name)  # fmt: skip
    return _refused(conversion, f"the model's JAX reference for {path.name} did not load: {problem}")


def route_after_convert_source(state: AgentState) -> Literal["review_conversion", "__end__"]:
    c = state.conversion
    if state.status == "failed" or c is None or c.reviewed:
        return "__end__"
    return "review_conversion" if state.mode == "hitl" else "__end__"


def review_conversion(state: AgentState, runtime: Runtime[Context]) -> dict[str, Any]:
    c = state.conversion
    assert c is not None and c.task_dir is not None
    ref = Path(c.task_dir) / "reference.py"
    status = "verified against the original on random inputs" if c.verified else f"NOT verified: {c.message}"
    description = (
        f"**Conversion of `{Path(c.source_path).name}`** ({c.kind}, written by {c.writer}): {status}.\n\n"
        "Approve to write Pallas kernels for this JAX reference, edit it, send feedback to the model, or stop."
    )
    answer = ask("conversion_review", description, code=ref.read_text(), verified=c.verified,
                 source_path=c.source_path, task_dir=c.task_dir)  # fmt: skip
    if answer.action == "stop":
        return {"status": "stopped", "stop_reason": "stopped at the conversion review",
                "conversion": c.model_copy(update={"reviewed": True})}  # fmt: skip
    if answer.action == "edit" and answer.code:
        ref.write_text(answer.code)
        note = (
            " (edited by a human: no longer the verified conversion)"
            if c.verified
            else " (edited by a human)"
        )
        return {"conversion": c.model_copy(update={"reviewed": True, "verified": False,
                                                   "message": c.message + note})}  # fmt: skip
    if answer.action == "feedback":
        return {"feedback": answer.feedback or "", "task_path": c.source_path,
                "conversion": c.model_copy(update={"task_dir": None})}  # fmt: skip
    return {"conversion": c.model_copy(update={"reviewed": True})}


def route_after_review(state: AgentState) -> Literal["convert_source", "__end__"]:
    c = state.conversion
    if c is not None and c.task_dir is None and state.status == "running":
        return "convert_source"  # feedback: the model writes the reference again
    return "__end__"
