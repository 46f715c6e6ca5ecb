"""How much of the benchmark suite the offline author covers: `maxkernel synthesize` on every task.

    .venv/bin/python benchmarks/offline_coverage.py [--suite benchmarks/suite] [--out out/offline_coverage]
                                                   [--tpu v5e,v6e] [--only SUBSTRING] [--repairs N]

Runs the tasks one after another (each is an analysis plus a full harness evaluation: interpret-mode
correctness on 3 input sets and an AOT Mosaic compile per TPU generation), prints one row per task — task,
family, accepted, and the stage and reason when not — then the total. Writes `summary.json` and
`summary.md` next to the per-task kernel.py / plan.md / result.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_task(task: Path, out: Path, args: argparse.Namespace) -> dict:
    dest = out / task.name
    cmd = [
        sys.executable,
        "-m",
        "maxkernel.cli",
        "synthesize",
        str(task),
        "--out",
        str(dest),
        "--tpu",
        args.tpu,
        "--json",
        "--repairs",
        str(args.repairs),
        "--timeout",
        str(args.timeout),
        "--work-dir",
        str(args.work_dir),
        "--store",
        str(args.work_dir / "results.db"),
    ]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout + 300, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {
            "task": task.name,
            "family": "?",
            "accepted": False,
            "stage": "timeout",
            "reason": "synthesize timed out",
            "seconds": time.monotonic() - t0,
        }
    row = {"task": task.name, "exit": proc.returncode, "seconds": round(time.monotonic() - t0, 1)}
    result_path = dest / "result.json"
    if result_path.exists():
        result = json.loads(result_path.read_text())
        err = result.get("error") or {}
        row.update(
            family=result.get("family", "?"),
            kernels="+".join(result.get("kernels") or []),
            accepted=bool(result.get("accepted")),
            stage=err.get("stage", ""),
            reason=(err.get("message") or "").strip().replace("\n", " | "),
        )
    else:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        row.update(
            family="?",
            kernels="",
            accepted=False,
            stage="task" if proc.returncode == 2 else "?",
            reason=tail[0],
        )
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", type=Path, default=REPO / "benchmarks" / "suite")
    p.add_argument("--out", type=Path, default=REPO / "out" / "offline_coverage")
    p.add_argument("--work-dir", type=Path, default=REPO / ".maxkernel")
    p.add_argument("--tpu", default="v5e,v6e")
    p.add_argument("--only", default="", help="run only tasks whose name contains this")
    p.add_argument("--repairs", type=int, default=0, help="repair attempts per task (default: one shot)")
    p.add_argument("--timeout", type=float, default=600.0, help="harness timeout per evaluation, seconds")
    args = p.parse_args()
    tasks = sorted(d for d in args.suite.iterdir() if (d / "reference.py").exists() and args.only in d.name)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    width = max((len(t.name) for t in tasks), default=10)
    print(f"{'task':{width}}  {'family':22} {'ok':3} {'s':>6}  stage: reason")
    for task in tasks:
        row = run_task(task, args.out, args)
        rows.append(row)
        reason = "" if row["accepted"] else f"{row['stage']}: {row['reason'][:160]}"
        print(
            f"{row['task']:{width}}  {row['family']:22} {'yes' if row['accepted'] else 'no':3} {row['seconds']:6.1f}  {reason}",
            flush=True,
        )
    n_ok = sum(1 for r in rows if r["accepted"])
    total = len(rows)
    pct = 100.0 * n_ok / total if total else 0.0
    print(f"\naccepted {n_ok} / {total} ({pct:.1f}%)")
    families: dict[str, int] = {}
    for r in rows:
        if r["accepted"]:
            families[r["family"]] = families.get(r["family"], 0) + 1
    print("accepted by family: " + ", ".join(f"{k} {v}" for k, v in sorted(families.items())))
    (args.out / "summary.json").write_text(
        json.dumps({"accepted": n_ok, "total": total, "rows": rows}, indent=2) + "\n"
    )
    md = ["| task | family | kernels | accepted | stage: reason |", "|---|---|---|---|---|"]
    for r in rows:
        reason = "" if r["accepted"] else f"{r['stage']}: {r['reason'][:200]}".replace("|", "\\|")
        md.append(
            f"| {r['task']} | {r['family']} | {r.get('kernels', '')} | {'yes' if r['accepted'] else 'no'} | {reason} |"
        )
    md.append(f"\n**accepted {n_ok} / {total} ({pct:.1f}%)**\n")
    (args.out / "summary.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
