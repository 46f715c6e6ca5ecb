"""Judging a kernel someone already has: `maxkernel eval` (the harness's verdict) and `maxkernel profile`
(a trace against the reference, with the TPU time estimates the harness reaches)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from maxkernel.cli.root import (
    DEFAULT_STORE,
    DEFAULT_TPU_TEXT,
    TPU_HELP,
    RayOpt,
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
    use_ray,
)
from maxkernel.tools.harness import EvalOptions, evaluate
from maxkernel.tools.results import EvalResult
from maxkernel.tools.tasks import TaskError, load_task

TASK_LOAD_TIMEOUT_S = 300.0


def read_source(path: Path) -> str:
    """The candidate's text. A file that is not UTF-8 text is a failed candidate (exit 1), said plainly."""
    if not path.is_file():
        raise fail_usage(f"kernel file not found: {path}")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        console.print(
            f"[bold red]rejected:[/] {path} is not UTF-8 text (byte {exc.start}): not a Python module"
        )
        raise typer.Exit(1) from exc


def eval_cmd(
    task: Annotated[
        Path,
        typer.Argument(
            help="task: a problem dir, a reference.py, a JAXBench workload dir or its baseline.py"
        ),
    ],
    kernel: Annotated[
        Path,
        typer.Argument(help="candidate kernel module exporting `computation` (or JAXBench's `workload`)"),
    ],
    json_out: Annotated[
        bool, typer.Option("--json", help="print one JSON object instead of a table")
    ] = False,
    tpu: TpuOpt = DEFAULT_TPU_TEXT,
    scale: ScaleOpt = None,
    input_sets: Annotated[int, typer.Option("--input-sets", min=1, help="input sets per configuration")] = 3,
    timeout: TimeoutOpt = None,
    allow_unsandboxed: Annotated[
        bool,
        typer.Option(
            "--allow-unsandboxed",
            help="run the kernel even where bubblewrap is missing (rlimits, scrubbed env, nobody when root; "
            "no file-system or network isolation)",
        ),
    ] = False,
    store: StoreOpt = DEFAULT_STORE,
    work_dir: WorkOpt = Path(".maxkernel"),
    ray: RayOpt = None,
) -> None:
    """Evaluate one candidate kernel: sandboxed load, trace, Pallas check, correctness, TPU compile."""
    gens = parse_tpus(tpu)
    source = read_source(kernel)
    address = use_ray(ray)
    try:
        with console.status(f"loading task {task} ..."):
            kt = load_task(task, scale=scale, work_dir=work_dir, timeout_s=timeout or TASK_LOAD_TIMEOUT_S)
    except TaskError as exc:
        raise fail_usage(str(exc)) from exc
    options = EvalOptions(
        tpu=gens, input_sets=input_sets, timeout_s=timeout, allow_unsandboxed=allow_unsandboxed
    )
    with console.status(f"evaluating {kernel.name} on {kt.task_id} ..."):
        from maxkernel.tools.cluster import runner_for

        result = evaluate(
            kt, source, options, store=open_store(store), work_dir=work_dir, runner=runner_for(address)
        )
    if result.error and result.error.stage == "task":
        if json_out:
            out.print_json(json.dumps(result.summary_json()))
        raise fail_usage(f"task {kt.task_id}: {result.error.message}")
    if json_out:
        print(json.dumps(result.summary_json()))
    else:
        render_eval(result)
    raise typer.Exit(0 if result.accepted else 1)


def profile_cmd(
    task: Annotated[Path, typer.Argument(help="task: a problem dir, a reference.py, or a JAXBench module")],
    kernel: Annotated[Path, typer.Argument(help="kernel module exporting `computation`")],
    tpu: Annotated[str, typer.Option("--tpu", help=f"{TPU_HELP}: estimated for")] = DEFAULT_TPU_TEXT,
    scale: Annotated[
        str | None, typer.Option("--scale", help="validation scale: cpu, tpu or a factor")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    work_dir: Annotated[Path, typer.Option("--work-dir", help="sandbox run dirs")] = Path(".maxkernel"),
    store: StoreOpt = DEFAULT_STORE,
    allow_unsandboxed: Annotated[
        bool,
        typer.Option(
            "--allow-unsandboxed", help="evaluate the kernel even where bubblewrap is missing (see evaluate)"
        ),
    ] = False,
) -> None:
    """Profile a kernel against its reference (on CPU: interpreted, labelled), with the TPU time estimates
    the harness reaches for it (an evaluation: a store hit when `maxkernel evaluate` ran it before)."""
    from maxkernel.tools.profiling import profile_kernel

    gens = parse_tpus(tpu)
    if not kernel.is_file():
        raise fail_usage(f"kernel file not found: {kernel}")
    try:
        kt = load_task(task, scale=scale, work_dir=work_dir)
    except TaskError as exc:
        raise fail_usage(str(exc)) from exc
    with console.status(f"profiling {kernel.name} on {kt.task_id} ..."):
        report = profile_kernel(
            kt, kernel.read_text(), gens, work_dir, store=open_store(store),
            evaluate_options=EvalOptions(tpu=gens, allow_unsandboxed=allow_unsandboxed),
        )  # fmt: skip
    if json_out:
        print(report.model_dump_json())
    else:
        print(report.to_markdown())
    raise typer.Exit(1 if report.error else 0)


def _yes(flag: bool) -> str:
    return "[green]yes[/]" if flag else "[red]no[/]"


def render_eval(r: EvalResult) -> None:
    t = Table(title=f"maxkernel eval — {r.task_id}", show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("result")
    t.add_row("accepted", _yes(r.accepted))
    t.add_row("uses Pallas", _yes(r.uses_pallas))
    t.add_row("correct", _yes(r.correct))
    if r.correctness:
        t.add_row("validated on", r.correctness.scale + "\n" + "\n".join(r.correctness.shapes_used))
        sets = ", ".join(f"{s.origin}{'✓' if s.ok else '✗'}" for s in r.correctness.sets)
        t.add_row("input sets", sets)
    if r.max_abs_err is not None:
        t.add_row("max abs / rel error", f"{r.max_abs_err:.3g} / {r.max_rel_err:.3g}")
    for gen, outcome in r.tpu_compile.items():
        msg = "[green]compiled[/]" if outcome.ok else f"[red]failed[/]: {(outcome.error or '')[:300]}"
        t.add_row(
            f"TPU {gen} (AOT Mosaic)", msg + (f" in {outcome.seconds:.2f} s" if outcome.seconds else "")
        )
    if r.timing:
        t.add_row(
            "measured",
            f"{r.timing.candidate_median_s * 1e3:.3f} ms (ref {r.timing.reference_median_s * 1e3:.3f} ms), "
            f"speedup {r.timing.measured_speedup:.2f}x on {r.timing.device}",
        )
    else:
        t.add_row("measured", "nothing (no TPU/GPU here)")
    if r.error:
        t.add_row("stopped at", f"[red]{r.error.stage}[/]: {r.error.message}")
    for w in r.warnings:
        t.add_row("note", w)
    t.add_row("sandbox", r.isolation + (" (cached result)" if r.cached else ""))
    if r.stage_seconds:
        t.add_row("time", ", ".join(f"{k} {v:.2f}s" for k, v in r.stage_seconds.items()))
    out.print(t)
