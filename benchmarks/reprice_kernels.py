"""Both estimates again, for kernels a bench already wrote: what an estimator change does to each speedup.

For each task, the kernel a bench or `maxkernel synthesize` left in `KERNELS/<task>/kernel.py` goes through
the block model (`estimate_pallas`) and the task's reference through the TPU compiler's model
(`estimate_xla`), at the task's own (TPU-scale) shapes, for each generation - with whatever estimator is
checked out. Run it at two commits over the same kernels and the difference is the estimator's alone (the
kernels do not change). Estimates only: nothing here runs on a TPU.

The kernels are imported into this process to trace them (no sandbox): point it only at kernels our own
offline author wrote, never at a candidate from elsewhere.

Run: ``.venv/bin/python benchmarks/reprice_kernels.py --kernels /tmp/s10-suite/tasks TASK ...``
A JAXBench checkout's workloads (``<dir>/<task>/baseline.py``, loaded as the harness loads them, statics and
small integer inputs included): ``--jaxbench PATH/JAXBench/benchmark --kernels OUT/jaxbench/tasks``, with no
task names for every task that has a kernel there.
To price with another commit's estimator, run the same command from an export of that commit
(``git archive COMMIT maxkernel benchmarks | tar -x -C DIR``, then ``cd DIR && python -m
benchmarks.reprice_kernels ...`` - the working directory comes first on the import path).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import jax

from maxkernel.tools.estimate import estimate_pallas, estimate_xla


def _module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _task_shapes(reference: ModuleType) -> tuple[list[jax.ShapeDtypeStruct], list[Any]]:
    """The first input configuration at TPU scale, as shapes (no GiB of random inputs) and statics."""
    statics: list[Any] = []

    def inputs() -> Any:
        out = reference.get_inputs()
        if isinstance(out, list) and out and isinstance(out[0], tuple):  # several configurations
            out = out[0]
        dynamic, static = out
        statics.extend(static)
        return dynamic

    shapes = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in jax.eval_shape(inputs)]
    return shapes, statics


def reprice_jaxbench(
    bench: Path, kernels: Path, task: str, gens: list[str]
) -> dict[str, tuple[float, float]]:
    """The same for a JAXBench workload, at its own shapes, as the harness loads it (`taskcode`): its
    statics passed as static arguments, its small integer inputs' values given to the block model."""
    from maxkernel.tools import taskcode
    from maxkernel.tools.results import np_dtype

    ref = taskcode.Reference({"format": "jaxbench", "reference_path": str(bench / task / "baseline.py")})
    dynamic, statics = taskcode.abstract_inputs(ref, None)[0]
    values = (taskcode.small_int_inputs(ref, None) or [{}])[0]
    entry = taskcode.candidate_entry(_module(kernels / task / "kernel.py", f"kernel_{task}"))
    if entry is None:
        raise ValueError("the kernel defines no computation")
    shapes = [jax.ShapeDtypeStruct(a.shape, np_dtype(a.dtype)) for a in dynamic]
    out = {}
    for gen in gens:
        jaxpr = jax.make_jaxpr(lambda *a: entry(*a, *statics))(*shapes)
        ours = estimate_pallas(jaxpr, gen, values).estimated_seconds
        xla = estimate_xla(lambda *a: ref.computation(*a, *statics), shapes, gen).estimated_seconds
        out[gen] = (ours, xla)
    return out


def reprice(suite: Path, kernels: Path, task: str, gens: list[str]) -> dict[str, tuple[float, float]]:
    """(kernel seconds, reference seconds) per generation, both estimated."""
    reference = _module(suite / task / "reference.py", f"reference_{task}")
    kernel = _module(kernels / task / "kernel.py", f"kernel_{task}")
    shapes, statics = _task_shapes(reference)
    out = {}
    for gen in gens:
        jaxpr = jax.make_jaxpr(lambda *a: kernel.computation(*a, *statics))(*shapes)
        ours = estimate_pallas(jaxpr, gen).estimated_seconds
        xla = estimate_xla(lambda *a: reference.computation(*a, *statics), shapes, gen).estimated_seconds
        out[gen] = (ours, xla)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tasks", nargs="*")
    parser.add_argument("--kernels", type=Path, required=True, help="dir holding <task>/kernel.py")
    parser.add_argument("--suite", type=Path, default=Path("benchmarks/suite"))
    parser.add_argument("--jaxbench", type=Path, help="a JAXBench benchmark dir (<task>/baseline.py)")
    parser.add_argument("--tpu", default="v5e,v6e")
    args = parser.parse_args()
    if not args.tasks:
        if args.jaxbench is None:
            parser.error("name the tasks (all of them by default only with --jaxbench)")
        args.tasks = sorted(
            p.parent.name
            for p in args.kernels.glob("*/kernel.py")
            if (args.jaxbench / p.parent.name / "baseline.py").is_file()
        )
    gens = [g for g in args.tpu.split(",") if g]
    import maxkernel.tools.estimate as estimator

    print(f"<!-- estimator: {estimator.__file__}; kernels: {args.kernels} (estimates, not measured) -->")
    print("| task | " + " | ".join(f"{g} kernel us | {g} XLA us | {g} speedup" for g in gens) + " |")
    print("|---|" + "---|---|---|" * len(gens))
    logs: dict[str, list[float]] = {g: [] for g in gens}
    for task in args.tasks:
        try:
            if args.jaxbench is not None:
                row = reprice_jaxbench(args.jaxbench, args.kernels, task, gens)
            else:
                row = reprice(args.suite, args.kernels, task, gens)
        except Exception as exc:  # noqa: BLE001 - one task failing must not hide the others' figures
            print(f"| {task} | failed: {type(exc).__name__}: {str(exc)[:120]} |")
            continue
        cells = []
        for g in gens:
            ours, xla = row[g]
            logs[g].append(math.log(xla / ours))
            cells.append(f"{ours * 1e6:.1f} | {xla * 1e6:.1f} | {xla / ours:.3f}x")
        print(f"| {task} | " + " | ".join(cells) + " |", flush=True)
    geomeans = [f"{math.exp(sum(v) / len(v)):.3f}x" if v else "-" for v in logs.values()]
    print("| geomean |" + "".join(f" | | {g} |" for g in geomeans))


if __name__ == "__main__":
    main()
