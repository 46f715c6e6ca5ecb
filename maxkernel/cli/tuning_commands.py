"""`maxkernel tuning export|import|show`: the store's tuning table as a JSON file (see tools/tuning_table.py).

Export on the machine that tuned (a TPU host measures), import where the next runs happen: their autotuner
then tries the recorded config first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from maxkernel.cli.root import DEFAULT_STORE, StoreOpt, fail_usage, open_store, out
from maxkernel.tools.tuning_table import TuningTable

tuning_app = typer.Typer(
    help="Tuned configs recorded by the autotuner: export, import, show.", no_args_is_help=True
)


@tuning_app.command("export")
def export(
    path: Annotated[Path, typer.Argument(help="JSON file to write")], store: StoreOpt = DEFAULT_STORE
) -> None:
    """Write every tuned config to a JSON file."""
    rows = TuningTable(open_store(store)).export()
    path.write_text(json.dumps(rows, indent=2) + "\n")
    out.print(f"{len(rows)} tuned configs -> {path}")


@tuning_app.command("import")
def import_(
    path: Annotated[Path, typer.Argument(help="JSON file written by `maxkernel tuning export`")],
    store: StoreOpt = DEFAULT_STORE,
) -> None:
    """Load tuned configs from a JSON file (a measured row is never replaced by an estimated one)."""
    if not path.is_file():
        raise fail_usage(f"file not found: {path}")
    try:
        rows = json.loads(path.read_text())
        written = TuningTable(open_store(store)).import_rows(rows)
    except (ValueError, TypeError) as exc:
        raise fail_usage(f"not a tuning export: {exc}") from exc
    out.print(f"{written} of {len(rows)} tuned configs imported into {store}")


@tuning_app.command("show")
def show(store: StoreOpt = DEFAULT_STORE) -> None:
    """List the tuned configs."""
    t = Table("family", "device kind", "argument shapes (bucketed)", "config", "ranked by", "speedup", "task")
    for r in TuningTable(open_store(store)).export():
        t.add_row(
            r["family"], r["device_kind"], r["arg_spec"], json.dumps(r["config"]), r["score_kind"],
            f"{r['score']:.2f}x", r["task_id"],
        )  # fmt: skip
    out.print(t)
