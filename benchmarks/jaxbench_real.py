"""Run maxkernel over the real JAXBench checkout (and MaxKernel's adapted set), at the defaults.

    python benchmarks/jaxbench_real.py PATH/TO/accelerator-agents [--jobs 2] [--out out/jaxbench-real]
        [--sets jaxbench,adapted] [--tasks GLOB] [--model offline]

PATH is a checkout (or an extracted archive) of AI-Hypercomputer/accelerator-agents holding `JAXBench/` and
`MaxKernel/evaluation/jaxbench_adapted_dataset/`. Nothing of it is copied into this repository: the bench
reads the workloads where they are. Each set runs `maxkernel bench` with its defaults (validation sizes
from the budget search, TPU targets v5e and v6e, one round of the offline author, hand-written kernels
side by side) into OUT/<set>/, then this prints the figures the write-up in benchmarks/jaxbench_real.md
quotes: correct, estimated geomeans per generation (JAXBench counting and over the correct), fast1, the
hand-written comparison, the families, wall time. Every speedup is an ESTIMATE: there is no TPU here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SETS = {
    "jaxbench": Path("JAXBench") / "benchmark",
    "adapted": Path("MaxKernel") / "evaluation" / "jaxbench_adapted_dataset",
}


def run_set(name: str, suite: Path, out: Path, args: argparse.Namespace) -> dict[str, object]:
    cmd = [
        sys.executable, "-m", "maxkernel", "bench", str(suite), "--model", args.model,
        "--jobs", str(args.jobs), "--out", str(out),
    ]  # fmt: skip
    if args.tasks:
        cmd += ["--tasks", args.tasks]
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, check=False)
    wall = time.monotonic() - t0
    return {"set": name, "exit": proc.returncode, "wall_min": round(wall / 60, 1), "out": str(out)}


def figures(out: Path) -> dict[str, object]:
    """The headline figures, recomputed from the bench's own results.db (the report's numbers)."""
    from maxkernel import bench

    rows = bench.load_rows(out)
    m = bench.summary(rows)
    published = bench.published_comparison(rows)
    human = bench.side_by_side(rows)
    return {
        "tasks": m["tasks"],
        "correct": m["correct"],
        "by_generation": m["by_generation"],
        "published_comparison": published,
        "hand_written": human,
        "families": bench.family_table(rows),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkout", type=Path)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("out/jaxbench-real"))
    parser.add_argument("--sets", default="jaxbench,adapted")
    parser.add_argument("--tasks", default=None, help="glob over workload ids")
    parser.add_argument("--model", default="offline")
    args = parser.parse_args()
    summary = []
    for name in [s.strip() for s in args.sets.split(",") if s.strip()]:
        if name not in SETS:
            parser.error(f"unknown set {name!r}; known: {', '.join(SETS)}")
        suite = args.checkout / SETS[name]
        if not suite.is_dir():
            parser.error(f"{suite} is not a directory: is {args.checkout} an accelerator-agents checkout?")
        info = run_set(name, suite, args.out / name, args)
        info["figures"] = figures(args.out / name)
        summary.append(info)
        print(json.dumps(info, indent=1, default=str), flush=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return 0 if all(s["exit"] == 0 for s in summary) else 1


if __name__ == "__main__":
    raise SystemExit(main())
