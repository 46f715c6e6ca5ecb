"""The root of the `maxkernel` command line: the Typer app, its two consoles, and the options and helpers
every command group shares (TPU targets, store, work dir, timeouts, Ray, usage errors).

Command groups live in their own modules beside this one and import from here only; `maxkernel.cli`
registers them on `app` in the order `--help` lists them. Nothing here imports a command module.

Exit codes, for every command: 0 success (a correct, accepted kernel), 1 the candidate failed or was
rejected, 2 the task or the command is bad (with a message naming the problem, never a traceback).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from maxkernel.tools.store import ResultsStore
from maxkernel.tools.store_sql import DatabaseUnavailable
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
        f"{Budget.seconds_per_set:g} s per input set allows), a budget such as 2s, tiles (a larger budget that "
        "keeps block multiples up to 2048 while other sizes can shrink: for kernels tuned with wide blocks), tpu "
        "(its own), or a shrink factor such as 0.25. TPU compiles always use the task's own shapes.",
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
CheckpointOpt = Annotated[
    str,
    typer.Option(
        "--checkpoint-db",
        envvar=CHECKPOINT_ENV,
        help="LangGraph checkpoints: a SQLite file or a postgresql:// URL",
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


@app.callback()
def _root() -> None:
    """Write, verify, autotune and profile JAX Pallas kernels for TPUs."""
