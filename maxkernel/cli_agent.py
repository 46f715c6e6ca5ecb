"""The agent's commands: `maxkernel optimize`, `maxkernel resume`, `maxkernel runs`.

Run settings (model, TPU targets, store, work dir) are recorded in the store's `runs` table under the
thread id, so `resume` in another process (or after `kill -9`) rebuilds exactly the same context.

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

from maxkernel.checkpointing import DEFAULT_CHECKPOINTS
from maxkernel.cli import (
    CHECKPOINT_ENV,
    DEFAULT_STORE,
    DEFAULT_TPU_TEXT,
    TPU_HELP,
    RayOpt,
    StoreOpt,
    app,
    console,
    fail_usage,
    open_store,
    out,
    parse_tpus,
    use_ray,
)
from maxkernel.cli_review import REVIEW_FLAGS, interactive_review, show_review, stdin_is_terminal
from maxkernel.context import Context, default_model
from maxkernel.nodes.finalize import verdict_style
from maxkernel.nodes.review import pending_review
from maxkernel.tools.results import SCORE_RANKS
from maxkernel.tools.store_sql import DatabaseUnavailable, is_postgres, postgres_pool

EXIT_PAUSED = 3
EXIT_MODEL_FAILURE = 4

CheckpointOpt = Annotated[
    str,
    typer.Option(
        "--checkpoint-db",
        envvar=CHECKPOINT_ENV,
        help="LangGraph checkpoints: a SQLite file or a postgresql:// URL",
    ),
]


def _take_lease(st: Any, thread_id: str) -> None:
    """One process per thread at a time (see `ResultsStore.hold_lease`): a second `resume` of a running
    thread refuses with the holder instead of running every evaluation twice."""
    holder = st.hold_lease(thread_id)
    if holder is not None:
        raise fail_usage(
            f"thread {thread_id} is being run by {holder} right now; wait for it to finish or stop it"
        )


def _lease_path(store: Path | str, thread_id: str) -> Path | None:
    """Where a SQLite store's lease for a thread lives (`ResultsStore.hold_lease`); None for PostgreSQL,
    whose leases are advisory locks in the server."""
    from maxkernel.tools.tasks import safe_task_id

    if is_postgres(str(store)):
        return None
    return Path(store).resolve().parent / "leases" / f"{safe_task_id(thread_id)}.lock"


def _owner() -> dict[str, Any]:
    """Who runs a thread, recorded with every 'running' status: `runs` tells a live run from one whose
    process was killed (pid + host; the heartbeat says how recently it finished a step)."""
    import os
    import socket
    import time

    return {"owner_pid": os.getpid(), "owner_host": socket.gethostname(), "heartbeat_at": time.time()}


def _owner_gone(row: dict[str, Any], store: Path | str | None) -> bool | None:
    """True when the process that last ran this thread is gone, False when it is alive, None when this
    machine cannot tell (another host, or a run recorded before owners were). On the owner's host the
    thread's lease decides (a lock the kernel drops when its holder dies, even by `kill -9`; a reused pid
    cannot fake it); without a lease file, whether the pid exists."""
    import fcntl
    import os
    import socket

    pid, host = row.get("owner_pid"), row.get("owner_host")
    if not pid or host != socket.gethostname():
        return None
    lease = _lease_path(store, row["thread_id"]) if store is not None else None
    if lease is not None and lease.exists():
        with open(lease, "a+") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # held: its owner is alive
            fcntl.flock(fh, fcntl.LOCK_UN)
            return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # a process with that pid exists (another user's)
    return False


def _graph(checkpoint_db: str, kind: str = "agent") -> Any:
    from maxkernel.checkpointing import checkpointer_for
    from maxkernel.graph.agent import compile_graph
    from maxkernel.graph.search import compile_search

    try:
        saver = checkpointer_for(checkpoint_db)
    except RuntimeError as exc:
        raise fail_usage(str(exc)) from exc
    return compile_search(saver) if kind == "search" else compile_graph(saver)


def _store(location: str) -> Any:
    return open_store(location)


def _describe(node: str, update: dict[str, Any], seen: dict[str, Any]) -> str:
    it = update.get("iteration", seen.get("iteration", 0))
    seen["iteration"] = it
    bits = []
    if node == "prepare" and update.get("task") is not None:
        task = update["task"]
        bits.append(f"task {task.task_id}: {'; '.join(c.describe() for c in task.configs)}")
    if node == "plan" and update.get("plan") is not None:
        bits.append(update["plan"].summary)
    if "attempts" in update:
        for a in update["attempts"]:
            cfg = f" {a.config}" if a.config else ""
            perf = f" ({a.estimate_text()})" if a.estimated_speedup is not None else ""
            if a.measured_speedup is not None:
                perf = f" (measured {a.measured_speedup:.2f}x)"
            bits.append(
                f"{a.kind}{cfg}: " + (f"accepted{perf}" if a.accepted else f"{a.stage} — {a.message[:140]}")
            )
    if update.get("best") is not None:
        b = update["best"]
        seen["best"] = b
        bits.append(f"new best [{b.source_hash[:10]}] ({b.score_text()})")
    for m in update.get("tool_messages") or []:
        bits.extend(_tool_line(m))
    if update.get("stop_reason"):
        bits.append(f"stop: {update['stop_reason']}")
    return escape(f"[round {it}] {node}" + (": " + " | ".join(bits) if bits else ""))


def _tool_line(message: Any) -> list[str]:
    """A model's tool request (`name(arg=...)`, a draft shown by its size) or a tool's answer (first line)."""
    calls = getattr(message, "tool_calls", None) or []
    if calls:
        shown = []
        for c in calls:
            args = ", ".join(
                f"{k}=<{len(v.splitlines())} lines>" if isinstance(v, str) and "\n" in v else f"{k}={v!r}"
                for k, v in (c.get("args") or {}).items()
            )
            shown.append(f"{c.get('name')}({args})")
        return ["asks for " + ", ".join(shown)]
    if getattr(message, "type", "") == "tool":
        first = next((ln for ln in str(message.content).splitlines() if ln.strip()), "")
        return [f"{getattr(message, 'name', None) or 'tool'} → {first[:120]}"]
    return []


def _drive(
    graph: Any,
    inp: Any,
    config: dict[str, Any],
    ctx: Context,
    *,
    search: bool = False,
    beat: Any = None,
) -> None:
    """Stream the run, one line per finished node (search runs: one line per branch verdict); `beat()`
    after each step (the run's heartbeat). A resumed thread's lines carry its round, not this process's."""
    seen: dict[str, Any] = {"iteration": graph.get_state(config).values.get("iteration", 0)}
    with console.status("working ...") as status:
        for chunk in graph.stream(inp, config, context=ctx, stream_mode="updates"):
            if beat is not None:
                beat()
            for node, update in chunk.items():
                if node == "__interrupt__":
                    continue
                update = update or {}
                console.print(_describe_search(node, update) if search else _describe(node, update, seen))
                status.update(f"after {node} ...")


def _run(
    graph: Any,
    inp: Any,
    config: dict[str, Any],
    ctx: Context,
    st: Any,
    thread_id: str,
    *,
    search: bool = False,
) -> None:
    """Drive the run; a model failure or a crash is recorded as the run's status (never left 'running'),
    and a model failure exits with EXIT_MODEL_FAILURE, saying that the thread can be resumed."""
    import time

    from maxkernel.authors.model_calls import FAILURE_KINDS, ModelCallError

    st.upsert_run(thread_id, status="running", **_owner())
    try:
        _drive(
            graph,
            inp,
            config,
            ctx,
            search=search,
            beat=lambda: st.upsert_run(thread_id, heartbeat_at=time.time()),
        )
    except ModelCallError as exc:
        st.upsert_run(thread_id, status=exc.kind)
        snapshot = graph.get_state(config)
        what = FAILURE_KINDS.get(exc.kind, ("model failure", False))[0]
        console.print(
            f"\n[bold red]{exc.kind}[/]: " + escape(f"{what} after {exc.attempts} attempt(s)"), soft_wrap=True
        )
        out.print(exc.detail, markup=False, highlight=False, soft_wrap=True)
        if exc.resume_after is not None:
            when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(exc.resume_after))
            console.print(
                f"the provider expects to answer again after {escape(when)} (in {exc.retry_after_s:.0f} s); "
                "resume then, or raise --backoff-max to wait that long in the process",
                soft_wrap=True,
            )
        best = snapshot.values.get("best")
        if best is not None and best.kind == "baseline":
            console.print(
                f"a correct offline baseline [{best.source_hash[:10]}] exists; it is the baseline, not a "
                "result of the model, and no kernel was written",
                soft_wrap=True,
            )
        at = ", ".join(snapshot.next) or "the failed step"
        console.print(f"stopped before {escape(at)}; continue with: maxkernel resume {thread_id}")
        raise typer.Exit(EXIT_MODEL_FAILURE) from None
    except KeyboardInterrupt:
        st.upsert_run(thread_id, status="interrupted")
        raise
    except Exception:
        st.upsert_run(thread_id, status="error")
        raise


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
        _run(graph, Command(resume=value), config, ctx, st, thread_id)


def _describe_search(node: str, update: dict[str, Any]) -> str:
    bits = []
    for n in update.get("nodes", []):
        perf = (
            (n.score_text or f"{n.score_kind} {n.score:.2f}x")
            if n.score is not None
            else ("correct" if n.accepted else "failed")
        )
        verdict = "" if node != "select" else (" kept" if n.kept else f" pruned ({n.reason[:80]})")
        bits.append(f"{n.id} [{n.strategy or 'root'}] {perf}{verdict}")
    if update.get("best") is not None:
        b = update["best"]
        bits.append(f"best so far {b.id}")
    return escape(f"[search] {node}" + (": " + " | ".join(bits) if bits else ""))


def _finish(graph: Any, config: dict[str, Any], store: Any, thread_id: str) -> None:
    """Report a paused or finished run and exit with the right code."""
    snapshot = graph.get_state(config)
    values = snapshot.values
    pending = [i for t in snapshot.tasks for i in t.interrupts]
    if "algorithm" in values:  # a search thread
        best = values.get("best")
        store.upsert_run(
            thread_id,
            status=values.get("status", "unknown"),
            best=json.dumps(
                {
                    "source_hash": best.source_hash,
                    "score": [SCORE_RANKS[best.score_kind], best.score or 0.0],
                }
            )
            if best
            else None,
        )
        console.print(f"\n[bold]{values.get('status')}[/]: best {best.id if best else 'none'}")
        if values.get("result_path"):
            try:
                verdict = json.loads(Path(values["result_path"]).read_text()).get("verdict") or {}
            except (OSError, ValueError):
                verdict = {}
            if verdict.get("line"):
                style = verdict_style(verdict["line"])
                console.print(f"[{style}]{escape(verdict['line'])}[/]")
            console.print(
                f"wrote {Path(values['result_path']).parent}/kernel.py, result.json, report.md, search_tree.png"
            )
        raise typer.Exit(0 if best is not None else 1)
    if pending:
        payload = pending_review(pending[0].value)
        store.upsert_run(thread_id, status=f"paused:{payload.get('kind')}")
        console.print(
            f"\n[bold yellow]paused for review[/] ({payload.get('kind')}), thread [bold]{thread_id}[/]"
        )
        show_review(payload)
        console.print(
            f"resume with: maxkernel resume {thread_id} {REVIEW_FLAGS.get(payload.get('kind'), '--approve')}"
        )
        raise typer.Exit(EXIT_PAUSED)
    status = values.get("status", "unknown")
    best = values.get("best")
    if best is not None and best.kind == "baseline" and values.get("usage") and values["usage"].model_calls:
        console.print("note: the kernel delivered is the offline baseline; no model-written kernel beat it")
    store.upsert_run(
        thread_id,
        status=status,
        best=json.dumps({"source_hash": best.source_hash, "score": list(best.score())}) if best else None,
    )
    result_path = values.get("result_path")
    console.print(f"\n[bold]{status}[/]: {escape(values.get('stop_reason') or '')}")
    if result_path:
        try:
            line = json.loads(Path(result_path).read_text()).get("verdict", {}).get("line")
        except (OSError, ValueError):
            line = None
        if line:
            style = verdict_style(line)
            console.print(f"[{style}]{escape(line)}[/]")
        console.print(f"wrote {Path(result_path).parent}/kernel.py, result.json, report.md")
    raise typer.Exit(0 if best is not None else 1)


@app.command("optimize")
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
    _run(graph, inp, config, ctx, st, thread_id)
    _review_loop(graph, config, ctx, st, thread_id)
    _check_bad_task(graph, config, st, thread_id)
    _finish(graph, config, st, thread_id)


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
    st = _store(store)
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
        **_owner(),
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
    if model != "offline":
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


@app.command("resume")
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

    st = _store(store)
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
        _finish(graph, config, st, thread_id)
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
    _run(graph, inp, config, ctx, st, thread_id, search=settings.get("graph") == "search")
    _review_loop(graph, config, ctx, st, thread_id)
    _finish(graph, config, st, thread_id)


@app.command("runs")
def runs_cmd(
    store: StoreOpt = DEFAULT_STORE,
    json_out: Annotated[bool, typer.Option("--json", help="print JSON lines")] = False,
) -> None:
    """List agent runs (threads) with status, task and best result."""
    rows = _store(store).list_runs()
    if json_out:  # the recorded row, plus what `runs` makes of it (`shown_status`)
        for r in rows:
            shown = _shown_status(r, json.loads(r.get("settings") or "{}"), store)
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
            _shown_status(r, settings, store),
            best_text,
            settings.get("model", ""),
            r.get("created_at") or "",
        )
    out.print(t)


def _shown_status(row: dict[str, Any], settings: dict[str, Any], store: Path | str | None = None) -> str:
    """The recorded status, except for a 'running' thread: with no checkpoint at all it never started;
    whose process is gone (killed, crashed, machine rebooted) it is interrupted and resumable; run by
    another host, it says which and when it last finished a step."""
    import socket
    import time

    status = row.get("status") or ""
    if status != "running":
        return status
    if not _has_checkpoint(row["thread_id"], settings.get("checkpoint_db") or ""):
        return "never started"
    gone = _owner_gone(row, store)
    if gone:
        return "interrupted (process gone), resumable"
    host = row.get("owner_host")
    if gone is None and host and host != socket.gethostname():
        beat = row.get("heartbeat_at")
        age = f", last step {time.time() - float(beat):.0f} s ago" if beat else ""
        return f"running on {host}{age}"
    return status


def _has_checkpoint(thread_id: str, db: str) -> bool:
    """Whether the checkpoint database holds anything for the thread (True when it cannot be read here:
    a Postgres URL or a locked file is no evidence of a run that never started)."""
    if db.startswith(("postgres://", "postgresql://")):
        return True
    if not Path(db).exists():
        return False
    import sqlite3

    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            found = conn.execute(
                "SELECT 1 FROM checkpoints WHERE thread_id = ? LIMIT 1", (thread_id,)
            ).fetchone()
    except sqlite3.Error:
        return True
    return found is not None


@app.command("profile")
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
    from maxkernel.tools.harness import EvalOptions
    from maxkernel.tools.profiling import profile_kernel
    from maxkernel.tools.tasks import TaskError, load_task

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


@app.command("search")
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
    _run(graph, search_inp, config, ctx, st, thread_id, search=True)
    _finish(graph, config, st, thread_id)


@app.command("bench")
def bench_cmd(
    suite: Annotated[
        Path,
        typer.Argument(
            help="a folder of problem dirs (e.g. benchmarks/suite), a JAXBench benchmark/ folder (or its "
            "checkout), or a single task"
        ),
    ],
    model: Annotated[str | None, typer.Option("--model", help="offline, or PROVIDER:MODEL")] = None,
    tasks: Annotated[
        str | None,
        typer.Option("--tasks", help="glob over task ids, e.g. 'fused_*' (several: comma separated)"),
    ] = None,
    scale: Annotated[
        str, typer.Option("--scale", help="validation scale: cpu, tpu or a shrink factor such as 0.125")
    ] = "cpu",
    jobs: Annotated[int, typer.Option("--jobs", min=1, help="tasks run at once")] = 1,
    out_dir: Annotated[Path, typer.Option("--out", help="output dir")] = Path("out/bench"),
    algorithm: Annotated[
        str | None, typer.Option("--algorithm", help="run a parallel|beam search per task")
    ] = None,
    iterations: Annotated[int, typer.Option("--iterations", min=1, help="agent rounds per task")] = 1,
    tpu: Annotated[str, typer.Option("--tpu", help=TPU_HELP)] = DEFAULT_TPU_TEXT,
    task_timeout: Annotated[float, typer.Option("--task-timeout", help="seconds per task")] = 1800.0,
    branches: Annotated[int, typer.Option("--branches", min=1, help="search branches per task")] = 2,
    tune_configs: Annotated[
        int,
        typer.Option(
            "--tune-configs",
            min=0,
            help="autotune configs per round (a second one helped 2 of 61 suite tasks by <1%)",
        ),
    ] = 1,
    order_from: Annotated[
        Path | None,
        typer.Option(
            "--order-from",
            help="an earlier bench's output dir: run tasks longest first by its timings (shorter tail with --jobs)",
        ),
    ] = None,
    search_tune_configs: Annotated[
        int, typer.Option("--search-tune-configs", min=0, help="autotune configs per search-branch round")
    ] = 1,
    search_below: Annotated[
        float,
        typer.Option(
            "--search-below",
            help="with --algorithm: search only tasks whose single round is correct and estimated below this",
        ),
    ] = 1.25,
    ray: RayOpt = None,
) -> None:
    """Run the agent over a suite; resumable; writes results.db, results.csv, report.md and plots.

    With --algorithm every task first gets a single round; the search then runs only where that round
    left headroom (--search-below), and the report shows both, per family."""
    from maxkernel.bench import Bench, BenchSettings, side_by_side, summary
    from maxkernel.tools.tasks import TaskError, parse_budget

    if scale not in ("cpu", "tpu"):
        try:
            factor_ok = 0 < float(scale) <= 1
        except ValueError:
            try:
                factor_ok = parse_budget(scale) is not None
            except TaskError:
                factor_ok = False
        if not factor_ok:
            raise fail_usage(
                "--scale must be cpu, tpu, a budget such as 2s or a shrink factor in (0, 1] such as 0.125"
            )
    if algorithm not in (None, "parallel", "beam"):
        raise fail_usage(f"--algorithm must be parallel or beam, not {algorithm!r}")
    address = use_ray(ray)
    if address is not None:  # each task's process connects to the same cluster (an embedded one: this one's)
        from maxkernel.tools.cluster import current

        cluster = current()
        address = cluster.address if cluster is not None else address
    settings = BenchSettings(
        ray_address=address,
        suite=str(suite.resolve()),
        out_dir=str(out_dir),
        model=model or default_model(),
        tasks=tasks,
        scale=scale,
        jobs=jobs,
        tpu=parse_tpus(tpu),
        iterations=iterations,
        algorithm=algorithm,
        task_timeout_s=task_timeout,
        branches=branches,
        tune_configs=tune_configs,
        order_from=str(order_from) if order_from else None,
        search_below=search_below,
        search_tune_configs=search_tune_configs,
    )
    try:
        bench = Bench(settings, on_progress=console.print)
        rows = bench.run()
    except FileNotFoundError as exc:
        raise fail_usage(str(exc)) from exc
    m = summary(rows)
    console.print(
        f"\ncorrect {m['correct']}/{m['tasks']}; geomean estimated speedup "
        f"{m['geomean_estimated_speedup'] or 0:.2f}x (estimate), fast1 {m['fast1_estimated']}, "
        f"> 1.25x {m['clear_estimated']}; final >= first accepted (estimated) {m['kept_first']}/"
        f"{m['kept_first_n']}"
        + (f" (NOT: {', '.join(m['slower_than_first'])})" if m["slower_than_first"] else "")
        + "; measured: "
        + (
            f"{m['geomean_measured_speedup']:.2f}x"
            if m["geomean_measured_speedup"]
            else "nothing measured (no device)"
        )
    )
    for g, v in m["by_generation"].items():
        console.print(
            f"  {g}: geomean estimated speedup {v['geomean'] or 0:.2f}x (estimate), fast1 {v['fast1']}, "
            f"> 1.25x {v['clear']} (over {v['n']} with a {g} estimate)"
        )
    sbs = side_by_side(rows)
    if sbs["workloads"]:
        console.print(
            f"hand-written kernels on {sbs['workloads']} workloads: {sbs['human_accepted']} pass our checks; "
            f"geomean estimated speedup ours {sbs['geomean_estimated_ours'] or 0:.2f}x vs hand-written "
            f"{sbs['geomean_estimated_human'] or 0:.2f}x vs XLA 1.00x (estimates; see report.md)"
        )
    console.print(f"wrote {out_dir}/report.md, results.csv, results.db")
