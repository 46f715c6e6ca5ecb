"""The `maxkernel` command line (`maxkernel --help`, `python -m maxkernel`, `python -m maxkernel.cli`).

`root` holds the Typer app and the options every group shares; each command group is a module of plain
functions that imports from `root` and never from here. This module is the one place that puts them on
the app, in the order `--help` lists them: adding a command is one entry in `COMMANDS`.

    eval_commands       eval, profile: judge a kernel someone already has
    synthesize_command  synthesize: one round of the offline author, no model
    agent_commands      optimize, search, resume, runs: checkpointed agent runs (shown by run_progress,
                        reviewed at a terminal by terminal_review; leases and owners: maxkernel.runs)
    bench_command       bench: the agent over a suite
    convert_command     convert: PyTorch (or CUDA/Triton, with a model) to a JAX task, and on to Pallas
    tuning_commands     tuning export|import|show: the autotuner's recorded configs
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from maxkernel.cli.agent_commands import optimize_cmd, resume_cmd, runs_cmd, search_cmd
from maxkernel.cli.bench_command import bench_cmd
from maxkernel.cli.convert_command import convert_cmd
from maxkernel.cli.eval_commands import eval_cmd, profile_cmd
from maxkernel.cli.root import app, console
from maxkernel.cli.synthesize_command import synthesize_cmd
from maxkernel.cli.tuning_commands import tuning_app

COMMANDS: tuple[tuple[str, Callable[..., Any]], ...] = (
    ("eval", eval_cmd),
    ("synthesize", synthesize_cmd),
    ("optimize", optimize_cmd),
    ("resume", resume_cmd),
    ("runs", runs_cmd),
    ("profile", profile_cmd),
    ("search", search_cmd),
    ("bench", bench_cmd),
    ("convert", convert_cmd),
)
"""Every top-level command, in the order `maxkernel --help` lists them (then the `tuning` group)."""

for _name, _command in COMMANDS:
    app.command(_name)(_command)
app.add_typer(tuning_app, name="tuning")


def main() -> None:
    """The console entry point (`maxkernel` in pyproject.toml)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        app()
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)


__all__ = ["COMMANDS", "app", "main"]
