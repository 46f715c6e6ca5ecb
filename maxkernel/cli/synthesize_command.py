"""`maxkernel synthesize`: one round of the agent graph with the offline author (no model), streamed, with
kernel.py, plan.md and result.json written as they come."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from maxkernel.cli.eval_commands import render_eval
from maxkernel.cli.root import (
    DEFAULT_STORE,
    DEFAULT_TPU_TEXT,
    ScaleOpt,
    StoreOpt,
    TimeoutOpt,
    TpuOpt,
    WorkOpt,
    console,
    fail_usage,
    open_store,
    out,
    parse_tpus,
)
from maxkernel.tools.results import EvalResult


def synthesize_cmd(
    task: Annotated[Path, typer.Argument(help="task: a problem dir, a reference.py, or a JAXBench module")],
    tpu: TpuOpt = DEFAULT_TPU_TEXT,
    scale: ScaleOpt = None,
    out_dir: Annotated[
        Path | None,
        typer.Option("--out", help="where kernel.py, plan.md and result.json go (default out/<task_id>)"),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="print the result JSON instead of a table")
    ] = False,
    repairs: Annotated[
        int, typer.Option("--repairs", min=0, help="repair attempts after a rejection (default: one shot)")
    ] = 0,
    timeout: TimeoutOpt = None,
    store: StoreOpt = DEFAULT_STORE,
    work_dir: WorkOpt = Path(".maxkernel"),
) -> None:
    """Write a kernel with the offline author (no model) from the reference's jaxpr, and evaluate it.

    This is one round of the agent graph (plan → implement → validate/test → repair), not a loop of its
    own: no autotuning, no profile, `--repairs` repair attempts. It streams the graph's state and writes
    kernel.py and a "no verdict yet" result.json each time a new kernel goes to the harness.
    """
    from maxkernel.context import OFFLINE_MODEL, Context
    from maxkernel.graph.agent import compile_graph
    from maxkernel.state import AgentInput, AgentState

    gens = parse_tpus(tpu)
    dest = out_dir
    ctx = Context(
        model=OFFLINE_MODEL,
        tpu=gens,
        store_path=open_store(store).location,
        work_dir=str(work_dir),
        eval_timeout_s=timeout,
    )
    run = AgentInput(
        task_path=str(task),
        scale=scale,
        max_iterations=1,
        tune_max_configs=0,
        max_repairs=repairs,
        # the graph's own finalize writes kernel.py/report.md here, away from synthesize's three files
        out_dir=str(Path(work_dir).resolve() / "synthesize" / (dest.name if dest else Path(task).stem)),
    )
    state: AgentState | None = None
    written: tuple[str | None, str | None] = (None, None)
    with console.status(f"synthesizing a kernel for {task} ...") as spinner:
        for values in compile_graph().stream(run.model_dump(), context=ctx, stream_mode="values"):
            state = AgentState.model_validate(values)
            if state.task is None:
                continue
            dest = dest or Path("out") / state.task.task_id
            dest.mkdir(parents=True, exist_ok=True)
            plan_text = state.plan.text if state.plan else None
            if plan_text is not None and plan_text != written[1]:
                (dest / "plan.md").write_text(plan_text)
            if state.source_path is not None and state.source_path != written[0]:
                (dest / "kernel.py").write_text(Path(state.source_path).read_text())
                # Until the verdict is in, result.json says so: a killed synthesize never leaves a bare kernel.py.
                pending = EvalResult(task_id=state.task.task_id, source_hash="").summary_json()
                pending["status"] = "evaluating: no verdict yet (if this stays, the run was interrupted)"
                pending["family"] = state.plan.family if state.plan else None
                (dest / "result.json").write_text(json.dumps(pending, indent=2) + "\n")
                spinner.update(f"evaluating the {pending['family']} kernel for {state.task.task_id} ...")
            written = (state.source_path, plan_text)
    assert state is not None
    if state.task is None:
        raise fail_usage(state.stop_reason or "the task could not be loaded")
    assert dest is not None
    plan = state.plan
    if plan is not None and not plan.supported:
        (dest / "kernel.py").unlink(missing_ok=True)
        summary = EvalResult(task_id=state.task.task_id, source_hash="").summary_json()
        summary["error"] = {"stage": "unsupported", "message": plan.unsupported_reason}
        summary["family"] = "unsupported"
        (dest / "result.json").write_text(json.dumps(summary, indent=2) + "\n")
        if json_out:
            print(json.dumps(summary))
        else:
            console.print(f"[bold red]unsupported:[/] {plan.unsupported_reason}")
            console.print(f"wrote {dest / 'plan.md'}, {dest / 'result.json'}")
        raise typer.Exit(1)
    result = state.eval_result
    if plan is None or result is None:
        raise fail_usage(f"task {state.task.task_id}: {state.stop_reason or 'no kernel was evaluated'}")
    summary = result.summary_json()
    summary["status"] = "finished"
    summary["family"] = plan.family
    summary["kernels"] = [k["family"] for k in plan.data.get("program", {}).get("kernels", [])]
    summary["config"] = state.source_config
    (dest / "result.json").write_text(json.dumps(summary, indent=2) + "\n")
    if result.error and result.error.stage == "task":
        if json_out:
            print(json.dumps(summary))
        raise fail_usage(f"task {state.task.task_id}: {result.error.message}")
    if json_out:
        print(json.dumps(summary))
    else:
        render_eval(result)
        out.print(
            f"family: {plan.family} ({', '.join(summary['kernels'])}); wrote {dest}/kernel.py, plan.md, result.json"
        )
    raise typer.Exit(0 if result.accepted else 1)
