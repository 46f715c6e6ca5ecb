"""How a run is shown while it runs and when it ends: one line per finished node (search runs: one per
branch verdict), the run's status recorded in the store as it goes, and the exit code it ends with.

Exit codes beyond the shared ones (`maxkernel.cli.root`): 3 paused for a human (hitl), 4 the model failed
(rate limited, unreachable, timed out, ...): the run stopped before the failed step and `maxkernel resume
THREAD` continues it once the model answers again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from maxkernel import runs
from maxkernel.cli.root import console, out
from maxkernel.cli.terminal_review import REVIEW_FLAGS, show_review
from maxkernel.context import Context
from maxkernel.nodes.finalize import verdict_style
from maxkernel.nodes.review import pending_review
from maxkernel.tools.results import SCORE_RANKS

EXIT_PAUSED = 3
EXIT_MODEL_FAILURE = 4


def describe(node: str, update: dict[str, Any], seen: dict[str, Any]) -> str:
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


def describe_search(node: str, update: dict[str, Any]) -> str:
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


def drive(
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
                console.print(describe_search(node, update) if search else describe(node, update, seen))
                status.update(f"after {node} ...")


def run_thread(
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

    st.upsert_run(thread_id, status="running", **runs.owner())
    try:
        drive(
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


def finish(graph: Any, config: dict[str, Any], store: Any, thread_id: str) -> None:
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
