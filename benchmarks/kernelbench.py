"""KernelBench read as it is: conversion rate over whole levels, and the agent on a fixed sample.

    python benchmarks/kernelbench.py convert KERNELBENCH_DIR [--levels 1,2] [--out out/kb-convert]
    python benchmarks/kernelbench.py agent KERNELBENCH_DIR [--levels 1,2] [--every 10] [--out out/kb-agent]

KERNELBENCH_DIR is a checkout's `KernelBench/` folder (the one holding level1 ... level4); nothing is
copied from it. `convert` runs `maxkernel convert` (one sandboxed conversion per task, in this process's
library call) on every task of the levels and prints, per level, how many were converted and verified
against PyTorch, the refusals by kind with the op they name, and the seconds per task. `agent` runs
`maxkernel bench LEVEL --jobs 1` with the offline author on every `--every`-th task by KernelBench number
(1, 1+every, ...) and prints the bench's KernelBench fast_p table (estimated, per TPU generation).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from maxkernel.convert import convert_torch_file
from maxkernel.convert.kernelbench import level_tasks


def convert_levels(root: Path, levels: list[str], out: Path) -> None:
    for level in levels:
        tasks = level_tasks(root / f"level{level}")
        rows = []
        for i, task in enumerate(tasks, 1):
            t0 = time.monotonic()
            r = convert_torch_file(task, out / f"level{level}" / task.stem, work_dir=out / "work")
            wall = time.monotonic() - t0
            rows.append({"task": task.name, "ok": r.ok, "seconds": round(wall, 1), "cached": r.cached,
                         "refusal": r.refusal.model_dump() if r.refusal else None})  # fmt: skip
            print(f"[level{level} {i}/{len(tasks)}] {task.name}: {'verified' if r.ok else r.message()[:200]} "
                  f"({wall:.1f} s{', cached' if r.cached else ''})", flush=True)  # fmt: skip
        (out / f"level{level}.json").write_text(json.dumps(rows, indent=2))
        ok = sum(r["ok"] for r in rows)
        secs = [r["seconds"] for r in rows if not r["cached"]]
        kinds = collections.Counter(r["refusal"]["kind"] for r in rows if r["refusal"])
        print(
            f"level{level}: {ok}/{len(rows)} converted and verified against PyTorch ({ok / max(1, len(rows)):.1%})"
        )
        if secs:
            print(f"  seconds per task: median {statistics.median(secs):.1f}, max {max(secs):.1f}")
        for kind, n in kinds.most_common():
            names = [r["refusal"]["what"] for r in rows if r["refusal"] and r["refusal"]["kind"] == kind]
            print(f"  refused ({kind}): {n}: {', '.join(sorted(set(names)))[:300]}")


def agent_sample(root: Path, levels: list[str], every: int, out: Path) -> None:
    for level in levels:
        tasks = level_tasks(root / f"level{level}")
        chosen = [t for t in tasks if int(t.name.split("_")[0]) % every == 1 % every]
        globs = ",".join(f"{t.name.split('_')[0]}_*" for t in chosen)
        dest = out / f"level{level}"
        cmd = [sys.executable, "-m", "maxkernel.cli", "bench", str(root / f"level{level}"), "--tasks", globs,
               "--jobs", "1", "--model", "offline", "--tpu", "v5e,v6e", "--out", str(dest)]  # fmt: skip
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=False)
        report = (dest / "report.md").read_text() if (dest / "report.md").exists() else ""
        section = report.split("## KernelBench fast_p", 1)
        if len(section) == 2:
            print("## KernelBench fast_p" + section[1].split("\n## ", 1)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("convert", "agent"))
    ap.add_argument("root", type=Path, help="a KernelBench checkout's KernelBench/ folder")
    ap.add_argument("--levels", default="1,2")
    ap.add_argument("--every", type=int, default=10, help="agent: every N-th task by KernelBench number")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    levels = [x.strip() for x in args.levels.split(",") if x.strip()]
    if args.what == "convert":
        convert_levels(args.root, levels, (args.out or Path("out/kb-convert")).resolve())
    else:
        agent_sample(args.root, levels, args.every, (args.out or Path("out/kb-agent")).resolve())


if __name__ == "__main__":
    main()
