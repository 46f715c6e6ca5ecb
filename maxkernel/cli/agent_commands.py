"""The agent's runs: `maxkernel optimize`, `maxkernel search`, `maxkernel resume`, `maxkernel runs`.

Run settings (model, TPU targets, store, work dir) are recorded in the store's `runs` table under the
thread id, so `resume` in another process (or after `kill -9`) rebuilds exactly the same context. Who runs
a thread, and whether that process lives, is `maxkernel.runs`; how a run is shown and with what exit code
it ends is `run_progress`.

Exit codes: 0 a correct kernel was found, 1 none was, 2 bad input, 3 paused for a human (hitl), 4 the model
failed (rate limited, unreachable, timed out, ...): the run stopped before the failed step and `maxkernel
resume THREAD` continues it once the model answers again.

Reviews: when stdin is a terminal, a paused run asks right there (approve / edit in $EDITOR / feedback /
stop or leave paused); otherwise it prints the pending review verbatim and the flags that answer it.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from maxkernel import runs
from maxkernel.checkpointing import DEFAULT_CHECKPOINTS
from maxkernel.cli.root import (
    DEFAULT_STORE,
    DEFAULT_TPU_TEXT,
    TPU_HELP,
    CheckpointOpt,
    RayOpt,
    StoreOpt,
    console,
    fail_usage,
    open_store,
    out,
    parse_tpus,
    use_ray,
)
from maxkernel.cli.run_progress import EXIT_PAUSED, finish, run_thread
from maxkernel.cli.terminal_review import REVIEW_FLAGS, interactive_review, show_review, stdin_is_terminal
from maxkernel.context import AuthorKind, Context, author_kind, default_model
from maxkernel.nodes.review import pending_review
from maxkernel.tools.store import ResultsStore
from maxkernel.tools.store_sql import DatabaseUnavailable, is_postgres, postgres_pool


def _take_lease(st: ResultsStore, thread_id: str) -> None:
    """The thread's lease (`runs.take_lease`); one held by another process is a usage error naming it."""
    try:
        runs.take_lease(st, thread_id)
    except runs.RunBusy as exc:
        raise fail_usage(str(exc)) from exc


def _graph(checkpoint_db: str, kind: str = "agent") -> Any:
    from maxkernel.checkpointing import checkpointer_for
    from maxkernel.graph.agent import compile_graph
    from maxkernel.graph.search import compile_search

    try:
        saver = checkpointer_for(checkpoint_db)
    except RuntimeError as exc:
        raise fail_usage(str(exc)) from exc
    return compile_search(saver) if kind == "search" else compile_graph(saver)


def _review_loop(graph: Any, config: dict[str, Any], ctx: Context, st: Any, thread_id: str) -> None:
    """On a terminal, answer each review as it comes and go on; elsewhere `_finish` shows it and exits."""
    from langgraph.types import Command

    while stdin_is_terminal():
        pending = [i for t in graph.get_state(config).tasks for i in t.interrupts]
        if not pending:
            return
        value = interactive_review(pending_review(pending[0].value))
        if value is None:
            return
        st.upsert_run(thread_id, status="running")
        run_thread(graph, Command(resume=value), config, ctx, st, thread_id)


def optimize_cmd(
    task: Annotated[Path, typer.Argument(help="task: a problem dir, a reference.py, or a JAXBench module")],
    model: Annotated[
        str | None,
        typer.Option("--model", help="offline, or PROVIDER:MODEL (google_genai:..., openai:..., ...)"),
    ] = None,
    mode: Annotated[str, typer.Option("--mode", help="auto (never interrupts) or hitl")] = "auto",
    iterations: Annotated[int, typer.Option("--iterations", min=1, help="rounds at most")] = 3,
    tpu: Annotated[str, typer.Option("--tpu", help=TPU_HELP)] = DEFAULT_TPU_TEXT,
    out_dir: Annotated[Path | None, typer.Option("--out", help="output dir (default out/TASK_ID)")] = None,
    scale: Annotated[
        str | None, typer.Option("--scale", help="validation scale: cpu, tpu or a factor")
    ] = None,
    strategy: Annotated[str | None, typer.Option("--strategy", help="strategy to apply first")] = None,
    tune_configs: Annotated[
        int, typer.Option("--tune-configs", min=0, help="autotune configs per round")
    ] = 6,
    checkpoint_db: CheckpointOpt = DEFAULT_CHECKPOINTS,
    store: StoreOpt = DEFAULT_STORE,
    work_dir: Annotated[Path, typer.Option("--work-dir", help="sandbox run dirs")] = Path(".maxkernel"),
    thread_id: Annotated[str | None, typer.Option("--thread-id", help="use this thread id")] = None,
    max_model_calls: Annotated[
        int | None, typer.Option("--max-model-calls", min=1, help="budget: model calls (failed ones count)")
    ] = None,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", min=1, help="budget: tokens")] = None,
    max_wall: Annotated[
        float | None, typer.Option("--max-wall", min=1, help="budget: wall-clock seconds")
    ] = None,
    patience: Annotated[
        int | None, typer.Option("--patience", min=1, help="stop after N rounds without improvement")
    ] = None,
    max_repairs: Annotated[
        int | None, typer.Option("--max-repairs", min=0, help="repairs per round at most")
    ] = None,
    model_retries: Annotated[
        int, typer.Option("--model-retries", min=0, help="retries of a transient model failure")
    ] = 4,
    backoff_max: Annotated[
        float,
        typer.Option(
            "--backoff-max",
            min=0,
            help="longest wait between retries, in seconds; a provider asking for longer (a daily quota) "
            "stops the run as rate_limited, resumable",
        ),
    ] = 120.0,
    request_timeout: Annotated[
        float, typer.Option("--request-timeout", min=1, help="seconds one model call may take")
    ] = 300.0,
    requests_per_second: Annotated[
        float | None, typer.Option("--requests-per-second", help="client-side rate limit for model calls")
    ] = None,
    model_tools: Annotated[
        int, typer.Option("--model-tools", min=0, help="tool calls (API look-up, draft check) per step")
    ] = 4,
    profile: Annotated[
        bool,
        typer.Option(
            "--profile/--no-profile",
            help="trace the best kernel on the CPU each round, for the model's reflection and the report's "
            "Profile section (the offline author does not read it; the bench skips it for the offline author)",
        ),
    ] = True,
    ray: RayOpt = None,
) -> None:
    """Run the agent loop on a task and write the best correct kernel, result.json and report.md."""
    if mode not in ("auto", "hitl"):
        raise fail_usage(f"--mode must be auto or hitl, not {mode!r}")
    if not task.exists():
        raise fail_usage(f"task not found: {task}")
    if strategy is not None:
        from maxkernel.strategies import get_strategy

        try:
            get_strategy(strategy)
        except KeyError as exc:
            raise fail_usage(str(exc.args[0])) from exc
    thread_id = thread_id or f"mk-{uuid.uuid4().hex[:12]}"
    limits = {
        "max_model_calls": max_model_calls,
        "max_tokens": max_tokens,
        "max_wall_s": max_wall,
        "patience": patience,
        "max_repairs": max_repairs,
        "model_retries": model_retries,
        "backoff_max_s": backoff_max,
        "request_timeout_s": request_timeout,
        "requests_per_second": requests_per_second,
        "model_tools": model_tools,
        "profile": profile,
    }
    st, settings = _start_run(
        "agent", thread_id, task, out_dir, model, tpu, checkpoint_db, store, work_dir, describe=f"mode {mode}",
        limits=limits, ray_address=use_ray(ray),
    )  # fmt: skip
    ctx = _started_context(st, thread_id, settings)
    graph = _graph(checkpoint_db)
    config = {"configurable": {"thread_id": thread_id}}
    inp = {
        "task_path": str(task.resolve()),
        "mode": mode,
        "max_iterations": iterations,
        "scale": scale,
        "out_dir": str(out_dir.resolve()) if out_dir else None,
        "strategy": strategy,
        "tune_max_configs": tune_configs,
    }
    run_thread(graph, inp, config, ctx, st, thread_id)
    _review_loop(graph, config, ctx, st, thread_id)
    _check_bad_task(graph, config, st, thread_id)
    finish(graph, config, st, thread_id)


def search_cmd(
    task: Annotated[Path, typer.Argument(help="task: a problem dir, a reference.py, or a JAXBench module")],
    algorithm: Annotated[str, typer.Option("--algorithm", help="parallel or beam")] = "parallel",
    branches: Annotated[
        int, typer.Option("--branches", min=1, help="parallel: branches; beam: children per node")
    ] = 4,
    beam_width: Annotated[int, typer.Option("--beam-width", min=1, help="beam: nodes kept per level")] = 2,
    depth: Annotated[int, typer.Option("--depth", min=1, help="beam: levels below the root")] = 2,
    keep_factor: Annotated[
        float, typer.Option("--keep-factor", help="beam: child must beat parent by this factor")
    ] = 1.0,
    iterations: Annotated[int, typer.Option("--iterations", min=1, help="agent rounds per branch")] = 1,
    tune_configs: Annotated[
        int, typer.Option("--tune-configs", min=0, help="autotune configs per branch round")
    ] = 2,
    strategies: Annotated[
        str | None, typer.Option("--strategies", help="comma-separated strategy names")
    ] = None,
    max_concurrency: Annotated[
        int | None,
        typer.Option(
            "--max-concurrency",
            min=1,
            help="branches running at once (default 2; with --ray the cluster's CPUs)",
        ),
    ] = None,
    model: Annotated[str | None, typer.Option("--model", help="offline, or PROVIDER:MODEL")] = None,
    tpu: Annotated[str, typer.Option("--tpu", help=TPU_HELP)] = DEFAULT_TPU_TEXT,
    out_dir: Annotated[Path | None, typer.Option("--out", help="output dir (default out/TASK_ID)")] = None,
    scale: Annotated[
        str | None, typer.Option("--scale", help="validation scale: cpu, tpu or a factor")
    ] = None,
    checkpoint_db: CheckpointOpt = DEFAULT_CHECKPOINTS,
    store: StoreOpt = DEFAULT_STORE,
    work_dir: Annotated[Path, typer.Option("--work-dir", help="sandbox run dirs")] = Path(".maxkernel"),
    thread_id: Annotated[str | None, typer.Option("--thread-id", help="use this thread id")] = None,
    profile: Annotated[
        bool, typer.Option("--profile/--no-profile", help="trace each branch's best kernel (see optimize)")
    ] = True,
    ray: RayOpt = None,
) -> None:
    """Search over optimisation strategies (parallel branches or a beam) and keep the best kernel."""
    from maxkernel.strategies import get_strategy

    if algorithm not in ("parallel", "beam"):
        raise fail_usage(f"--algorithm must be parallel or beam, not {algorithm!r}")
    if not task.exists():
        raise fail_usage(f"task not found: {task}")
    names = [x.strip() for x in strategies.split(",") if x.strip()] if strategies else None
    for name in names or []:
        try:
            get_strategy(name)
        except KeyError as exc:
            raise fail_usage(str(exc.args[0])) from exc
    thread_id = thread_id or f"ms-{uuid.uuid4().hex[:12]}"
    address = use_ray(ray)
    if max_concurrency is None:
        from maxkernel.tools.cluster import runner_for

        runner = runner_for(address)
        max_concurrency = runner.capacity if runner is not None else 2
    st, settings = _start_run(
        "search", thread_id, task, out_dir, model, tpu, checkpoint_db, store, work_dir,
        describe=f"{algorithm} search", max_concurrency=max_concurrency, ray_address=address,
        limits={"profile": profile},
    )  # fmt: skip
    ctx = _started_context(st, thread_id, settings)
    graph = _graph(checkpoint_db, "search")
    config = {"configurable": {"thread_id": thread_id}, "max_concurrency": max_concurrency}
    search_inp = {
        "task_path": str(task.resolve()),
        "algorithm": algorithm,
        "branches": branches,
        "beam_width": beam_width,
        "depth": depth,
        "keep_factor": keep_factor,
        "iterations": iterations,
        "tune_max_configs": tune_configs,
        "strategies": names,
        "scale": scale,
        "out_dir": str(out_dir.resolve()) if out_dir else None,
    }
    run_thread(graph, search_inp, config, ctx, st, thread_id, search=True)
    finish(graph, config, st, thread_id)


def _start_run(
    kind: str,
    thread_id: str,
    task: Path,
    out_dir: Path | None,
    model: str | None,
    tpu: str,
    checkpoint_db: str,
    store: str,
    work_dir: Path,
    *,
    describe: str,
    **extra: Any,
) -> tuple[Any, dict[str, Any]]:
    """Record a new thread and the settings `resume` needs to rebuild its context in another process."""
    gens = parse_tpus(tpu)
    st = open_store(store)
    if is_postgres(checkpoint_db):  # an unusable checkpoint URL fails before the run is recorded
        try:
            postgres_pool(checkpoint_db)
        except DatabaseUnavailable as exc:
            raise fail_usage(str(exc)) from exc
    _take_lease(st, thread_id)
    settings = {
        "graph": kind,
        "model": model or default_model(),
        "tpu": gens,
        "store_path": st.location,
        "work_dir": str(work_dir.resolve()),
        "checkpoint_db": checkpoint_db,
        **extra,
    }
    st.upsert_run(
        thread_id,
        task_id=task.stem if task.is_file() else task.name,
        task_path=str(task.resolve()),
        settings=json.dumps(settings),
        status="running",
        **runs.owner(),
        out_dir=str(out_dir.resolve()) if out_dir else None,
    )
    console.print(
        f"thread [bold]{thread_id}[/] — {describe}, model {settings['model']}, TPU {', '.join(gens)}"
    )
    return st, settings


def _check_bad_task(graph: Any, config: dict[str, Any], st: Any = None, thread_id: str = "") -> None:
    values = graph.get_state(config).values
    reason = values.get("stop_reason") or ""
    if values.get("task") is None and reason.startswith("bad task"):
        if st is not None:
            st.upsert_run(thread_id, status="failed to start")
        raise fail_usage(escape(reason))


def _context(settings: dict[str, Any]) -> Context:
    model = settings["model"]
    if author_kind(model) is AuthorKind.MODEL:
        from maxkernel.authors.base import AuthorError
        from maxkernel.authors.llm import init_model

        try:
            init_model(model)  # a bad model string or a missing integration is a usage error, up front
        except AuthorError as exc:
            raise fail_usage(str(exc)) from exc
    limits = {k: v for k, v in (settings.get("limits") or {}).items() if v is not None}
    return Context(
        model=model,
        tpu=list(settings["tpu"]),
        store_path=settings["store_path"],
        work_dir=settings["work_dir"],
        ray_address=use_ray(settings.get("ray_address")),
        **limits,
    )


def _started_context(st: Any, thread_id: str, settings: dict[str, Any]) -> Context:
    """The context of a run just recorded; a run whose model cannot even be created is marked as such
    (never left 'running')."""
    try:
        return _context(settings)
    except typer.Exit:
        st.upsert_run(thread_id, status="failed to start")
        raise


def _resume_value(
    kind: str, approve: bool, plan_file: Path | None, code_file: Path | None, feedback: str | None, stop: bool
) -> dict[str, Any]:
    from maxkernel.nodes.review import answer

    given = {
        "approve": approve,
        "plan_file": plan_file,
        "code_file": code_file,
        "feedback": feedback,
        "stop": stop,
    }
    chosen = [option for option, x in given.items() if x]
    if len(chosen) != 1:
        raise fail_usage("give exactly one of --approve, --plan-file, --code-file, --feedback, --stop")
    option = chosen[0]
    raw = given[option]
    text = _read(raw) if isinstance(raw, Path) else (raw if isinstance(raw, str) else None)
    try:
        return answer(kind, option, text)
    except KeyError:
        raise fail_usage(f"that option does not answer a {kind} review") from None


def _read(path: Path) -> str:
    if not path.is_file():
        raise fail_usage(f"file not found: {path}")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise fail_usage(f"{path} is not UTF-8 text") from exc


def resume_cmd(
    thread_id: Annotated[str, typer.Argument(help="the thread id printed when the run started")],
    approve: Annotated[
        bool, typer.Option("--approve", help="approve the pending plan/code, or retry")
    ] = False,
    plan_file: Annotated[
        Path | None, typer.Option("--plan-file", help="replace the plan with this file")
    ] = None,
    code_file: Annotated[
        Path | None, typer.Option("--code-file", help="replace the kernel with this file")
    ] = None,
    feedback: Annotated[str | None, typer.Option("--feedback", help="feedback for the author")] = None,
    stop: Annotated[bool, typer.Option("--stop", help="stop the run (at a failure review)")] = False,
    checkpoint_db: Annotated[
        str | None, typer.Option("--checkpoint-db", help="override the recorded one")
    ] = None,
    store: StoreOpt = DEFAULT_STORE,
    ray: RayOpt = None,
) -> None:
    """Continue a paused (hitl), killed or model-failed run from its last checkpoint. Without an answer
    flag, a pending review is shown (on a terminal: asked). --ray overrides the recorded Ray address (an
    embedded instance ends with its process)."""
    from langgraph.types import Command

    st = open_store(store)
    run = st.get_run(thread_id)
    if run is None:
        raise fail_usage(f"no run with thread id {thread_id!r} in {store}")
    _take_lease(st, thread_id)
    settings = json.loads(run["settings"])
    if ray is not None:
        settings["ray_address"] = ray
    graph = _graph(checkpoint_db or settings["checkpoint_db"], settings.get("graph", "agent"))
    config = {"configurable": {"thread_id": thread_id}}
    snapshot = graph.get_state(config)
    if not snapshot.values:
        raise fail_usage(
            f"thread {thread_id} has no checkpoint in {checkpoint_db or settings['checkpoint_db']}"
        )
    pending = [i for t in snapshot.tasks for i in t.interrupts]
    ctx = _context(settings)
    if pending and not any((approve, plan_file, code_file, feedback, stop)):
        payload = pending_review(pending[0].value)
        value = interactive_review(payload) if stdin_is_terminal() else None
        if value is None:  # not a terminal (or the person left it paused): show what waits, and how to answer
            show_review(payload)
            console.print(
                f"answer with: maxkernel resume {thread_id} {REVIEW_FLAGS.get(payload.get('kind'), '--approve')}"
            )
            raise typer.Exit(EXIT_PAUSED)
        inp: Any = Command(resume=value)
    elif pending:
        value = _resume_value(
            pending_review(pending[0].value).get("kind", ""), approve, plan_file, code_file, feedback, stop
        )
        inp = Command(resume=value)
    elif not snapshot.next:
        console.print(f"thread {thread_id} already finished")
        finish(graph, config, st, thread_id)
        return
    else:
        if any((approve, plan_file, code_file, feedback, stop)):
            console.print(
                "note: nothing is waiting for review; the options are ignored and the run continues"
            )
        inp = None
    st.upsert_run(thread_id, status="running")
    console.print(f"resuming thread [bold]{thread_id}[/] at {', '.join(snapshot.next)}")
    if settings.get("max_concurrency"):
        config["max_concurrency"] = settings["max_concurrency"]
    run_thread(graph, inp, config, ctx, st, thread_id, search=settings.get("graph") == "search")
    _review_loop(graph, config, ctx, st, thread_id)
    finish(graph, config, st, thread_id)


def runs_cmd(
    store: StoreOpt = DEFAULT_STORE,
    json_out: Annotated[bool, typer.Option("--json", help="print JSON lines")] = False,
) -> None:
    """List agent runs (threads) with status, task and best result."""
    rows = open_store(store).list_runs()
    if json_out:  # the recorded row, plus what `runs` makes of it (`shown_status`)
        for r in rows:
            shown = runs.shown_status(r, json.loads(r.get("settings") or "{}"), store)
            print(json.dumps({**r, "shown_status": shown}))
        return
    t = Table(title=f"runs in {store}")
    for col in ("thread", "task", "status", "best", "model", "started"):
        t.add_column(col)
    for r in rows:
        settings = json.loads(r.get("settings") or "{}")
        best = json.loads(r["best"]) if r.get("best") else None
        best_text = "—"
        if best:
            kind, value = best["score"]
            best_text = f"{best['source_hash'][:10]} " + {
                2: f"measured {value:.2f}x",
                1: f"estimated {value:.2f}x",
            }.get(kind, "correct")
        t.add_row(
            r["thread_id"],
            r.get("task_id") or "",
            runs.shown_status(r, settings, store),
            best_text,
            settings.get("model", ""),
            r.get("created_at") or "",
        )
    out.print(t)
