"""`maxkernel convert`: a PyTorch file (or, with a model, a CUDA/Triton kernel) to a JAX task, and on to
Pallas with `--to pallas` (the agent, with the conversion as its first, reviewed step)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from maxkernel.checkpointing import DEFAULT_CHECKPOINTS
from maxkernel.cli.agent_commands import optimize_cmd
from maxkernel.cli.root import DEFAULT_STORE, DEFAULT_TPU_TEXT, TPU_HELP, console, fail_usage, out
from maxkernel.convert import convert_torch_file, source_kind
from maxkernel.convert.torch_task import CONVERT_TIMEOUT_S


def convert_cmd(
    file: Annotated[
        Path,
        typer.Argument(help="a PyTorch file (KernelBench format, or --module NAME), a .cu or Triton file"),
    ],
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="the problem dir to write (default: converted/<file stem>)")
    ] = None,
    module: Annotated[
        str | None, typer.Option("--module", help="the nn.Module class to convert (default: Model)")
    ] = None,
    to: Annotated[
        str, typer.Option("--to", help="jax: write the JAX task; pallas: then run the agent on it")
    ] = "jax",
    model: Annotated[
        str | None, typer.Option("--model", help="offline, or PROVIDER:MODEL (needed for CUDA/Triton)")
    ] = None,
    mode: Annotated[
        str | None,
        typer.Option("--mode", help="with --to pallas: hitl (default: review the JAX reference) or auto"),
    ] = None,
    draws: Annotated[int, typer.Option("--draws", min=1, help="random draws of each kind to verify on")] = 3,
    iterations: Annotated[
        int, typer.Option("--iterations", min=1, help="with --to pallas: agent rounds")
    ] = 3,
    tpu: Annotated[str, typer.Option("--tpu", help=TPU_HELP)] = DEFAULT_TPU_TEXT,
    json_out: Annotated[bool, typer.Option("--json", help="print the conversion result as JSON")] = False,
    timeout: Annotated[
        float, typer.Option("--timeout", help="seconds the conversion may take")
    ] = CONVERT_TIMEOUT_S,
    checkpoint_db: Annotated[
        str, typer.Option("--checkpoint-db", help="with --to pallas")
    ] = DEFAULT_CHECKPOINTS,
    store: Annotated[str, typer.Option("--store", help="with --to pallas: results store")] = DEFAULT_STORE,
    work_dir: Annotated[Path, typer.Option("--work-dir", help="sandbox run dirs")] = Path(".maxkernel"),
) -> None:
    """PyTorch -> a verified JAX task (reference.py + kernel_task.yaml + conversion.json); `--to pallas`
    goes on to write Pallas kernels for it (CUDA and Triton need --model; the JAX reference is reviewed)."""
    if to not in ("jax", "pallas"):
        raise fail_usage(f"--to must be jax or pallas, not {to!r}")
    if not file.is_file():
        raise fail_usage(f"file not found: {file}")
    kind = source_kind(file)
    if to == "pallas":
        optimize_cmd(
            task=file, model=model, mode=mode or "hitl", iterations=iterations, tpu=tpu, out_dir=out_dir,
            checkpoint_db=checkpoint_db, store=store, work_dir=work_dir,
        )  # fmt: skip
        return
    if mode is not None:
        raise fail_usage("--mode applies to --to pallas (a plain conversion never pauses)")
    if kind in ("cuda", "triton"):
        raise fail_usage(
            f"{file.name} is a {kind} kernel: its JAX reference is written by a model and reviewed before use; "
            "run `maxkernel convert FILE --to pallas --model PROVIDER:MODEL`"
        )
    if kind != "pytorch":
        raise fail_usage(f"{file.name} is not a PyTorch module file (no `import torch`): nothing to convert")
    dest = out_dir or Path("converted") / file.stem
    with console.status(f"converting {file.name} (sandboxed: trace with torchax, write JAX, verify) ..."):
        result = convert_torch_file(
            file, dest, class_name=module, draws=draws, work_dir=work_dir, timeout_s=timeout
        )
    if json_out:
        print(json.dumps(result.model_dump(mode="json")))
    if result.ok:
        if not json_out:
            out.print(escape(result.message()))
        raise typer.Exit(0)
    if result.task_dir and result.refusal is not None and result.refusal.kind == "mismatch":
        console.print(f"[bold red]not verified:[/] {escape(result.message())}")
        console.print(f"the unverified task is in {result.task_dir} (conversion.json has every check)")
        raise typer.Exit(1)
    raise fail_usage(result.message())
