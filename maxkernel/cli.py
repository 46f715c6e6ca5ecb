"""The `maxkernel` command line.

Exit codes, for every command: 0 success (a correct, accepted kernel), 1 the candidate failed or was
rejected, 2 the task or the command is bad (with a message naming the problem, never a traceback).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from maxkernel.tools.harness import EvalOptions, evaluate
from maxkernel.tools.results import EvalResult
from maxkernel.tools.store import ResultsStore
from maxkernel.tools.store_sql import DatabaseUnavailable
from maxkernel.tools.tasks import TaskError, load_task
from maxkernel.tools.tpu_specs import DEFAULT_GENERATIONS, GENERATIONS, normalise_generations
from maxkernel.tools.validation_sizing import Budget

DEFAULT_TPU_TEXT = ",".join(DEFAULT_GENERATIONS)
TPU_HELP = f"TPU generations, comma separated ({','.join(GENERATIONS)}; aliases such as trillium accepted)"

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Write, verify, autotune and profile JAX Pallas kernels for TPUs.",
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)
out = Console()

TpuOpt = Annotated[str, typer.Option("--tpu", help=f"{TPU_HELP}: compiled for")]
ScaleOpt = Annotated[
    str | None,
    typer.Option(
        "--scale",
        help="validation shapes: cpu (the default: the task's CPU-scale shapes, else the largest the budget of "
        f"{Budget.seconds_per_set:g} s per input set allows), a budget such as 2s, tpu (its own), or a shrink "
        "factor such as 0.25. TPU compiles always use the task's own shapes.",
    ),
]
DEFAULT_STORE = ".maxkernel/results.db"
STORE_ENV = "MAXKERNEL_STORE"
CHECKPOINT_ENV = "MAXKERNEL_CHECKPOINT_DB"
StoreOpt = Annotated[
    str,
    typer.Option(
        "--store",
        envvar=STORE_ENV,
        help="results store: a SQLite file or a postgresql:// URL (shared by a team); evaluations found "
        "there are not re-run",
    ),
]
WorkOpt = Annotated[Path, typer.Option("--work-dir", help="where sandbox run directories go")]
TimeoutOpt = Annotated[
    float | None,
    typer.Option(
        "--timeout",
        help="seconds before loading the task, or one evaluation, is killed (default: derived from the "
        "task's reference time plus a compile budget, 60-600 s; task loading: 300 s)",
    ),
]
TASK_LOAD_TIMEOUT_S = 300.0
RayOpt = Annotated[
    str | None,
    typer.Option(
        "--ray",
        help="run evaluations on Ray: 'auto' (an embedded local instance) or a cluster's HOST:PORT (what "
        "`ray start --head` prints); default $MAXKERNEL_RAY_ADDRESS, else locally without Ray",
    ),
]


def use_ray(flag: str | None) -> str | None:
    """The Ray address from --ray or $MAXKERNEL_RAY_ADDRESS, connected up front so that a bad address is
    exit 2 in seconds (never a hang, never a traceback mid-run); None: evaluate locally. Ctrl-C and SIGTERM
    then cancel the evaluations in flight on the workers before the process ends."""
    import os
    import signal

    from maxkernel.tools import cluster

    address = (flag or os.environ.get(cluster.RAY_ADDRESS_ENV) or "").strip() or None
    if address is None:
        return None
    logging.getLogger("maxkernel.cluster").setLevel(logging.INFO)
    try:
        with console.status(f"connecting to Ray ({address}) ..."):
            cluster.connect(address)
    except cluster.ClusterError as exc:
        raise fail_usage(str(exc)) from exc

    def interrupted(signum: int, _frame: object) -> None:
        cluster.cancel_all()
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupted)
    return address


def fail_usage(message: str) -> typer.Exit:
    # a message may hold [brackets] (not markup) and paths (not wrapped: a user copies them)
    console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    return typer.Exit(2)


def open_store(location: str | Path) -> ResultsStore:
    """The results store at a path or URL; one that cannot be used (unreachable server, bad URL, wrong
    credentials) is a usage error, exit 2, within the connect timeout."""
    try:
        return ResultsStore(location)
    except DatabaseUnavailable as exc:
        raise fail_usage(str(exc)) from exc


def parse_tpus(text: str) -> list[str]:
    try:
        return normalise_generations(text)
    except ValueError as exc:
        raise fail_usage(str(exc)) from exc


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


@app.callback()
def _root() -> None:
    """Write, verify, autotune and profile JAX Pallas kernels for TPUs."""


@app.command("eval")
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


@app.command("synthesize")
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
    from maxkernel.context import Context
    from maxkernel.graph.agent import compile_graph
    from maxkernel.state import AgentInput, AgentState

    gens = parse_tpus(tpu)
    dest = out_dir
    ctx = Context(
        model="offline",
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


def _register_agent_commands() -> None:
    import maxkernel.cli_agent  # noqa: F401 - registers optimize / resume / runs on `app`
    import maxkernel.cli_convert  # noqa: F401 - registers `convert`
    import maxkernel.cli_tuning  # noqa: F401 - registers `tuning export|import|show`


def main() -> None:
    _register_agent_commands()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        app()
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    # Run through the package module so the commands registered on `maxkernel.cli.app` are the ones used.
    from maxkernel.cli import main as package_main

    package_main()
