"""`maxkernel bench`: the agent over a suite of tasks (each in its own process), resumable, with a report
per family and per generation (`maxkernel.bench` runs it; this module reads the options and prints)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from maxkernel.cli.root import DEFAULT_TPU_TEXT, TPU_HELP, RayOpt, console, fail_usage, parse_tpus, use_ray
from maxkernel.context import default_model


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
    from maxkernel.tools.tasks import TILES_SCALE, TaskError, parse_budget

    if scale not in ("cpu", "tpu", TILES_SCALE):
        try:
            factor_ok = 0 < float(scale) <= 1
        except ValueError:
            try:
                factor_ok = parse_budget(scale) is not None
            except TaskError:
                factor_ok = False
        if not factor_ok:
            raise fail_usage(
                "--scale must be cpu, tpu, tiles, a budget such as 2s or a shrink factor in (0, 1] such as 0.125"
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
