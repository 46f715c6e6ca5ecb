"""How long one candidate evaluation takes, sandbox included, and where the time goes.

Task: the bundled example at CPU scale (relu(x @ w + b), 256x512 @ 512x384, f32), the bundled kernel,
3 input sets and one ahead-of-time TPU compile (v5e) — the figure the harness issue sets a target for
(<= 3 s median on a 2-core machine). Each run evaluates a distinct candidate (the kernel with a different
trailing comment), so nothing is served from the results store; every run is a full sandboxed
evaluation. The first one also computes the task's own input sets and the compiler's estimate of the
reference, which later candidates of the same task reuse (`maxkernel.tools.reference_cache`; the secret
draws and the reference's outputs on them are computed afresh every time) — that is the agent's steady
state, reported separately.

The goal of issue 16 is a median evaluation of at most 1.5x a bare JAX start on the same machine; the bare
start (`python -c "import jax, jax.numpy as jnp; jnp.ones(3).block_until_ready()"`) is measured in the same
run, interleaved with the evaluations so that both see the same load, and the ratio is printed. With the
zygote (the default), the first evaluation also starts the zygotes (the JAX import, once).

    python benchmarks/eval_speed.py [--runs 7] [--no-larger-shape] [--no-zygote]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from maxkernel.tools.harness import EvalOptions, evaluate
from maxkernel.tools.store import ResultsStore
from maxkernel.tools.tasks import load_task

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument(
        "--no-larger-shape",
        action="store_true",
        help="leave out the check at a second, larger shape (to measure what it costs, under the same load)",
    )
    parser.add_argument(
        "--no-zygote", action="store_true", help="spawn fresh sandboxed children (the path before issue 16)"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="maxkernel-bench-"))
    store = ResultsStore(work / "results.db")
    example = ROOT / "examples" / "matmul_bias_relu"
    t0 = time.perf_counter()
    task = load_task(example, work_dir=work)
    print(f"task load (sandboxed describe): {time.perf_counter() - t0:.2f} s")
    source = (example / "kernel.py").read_text()
    walls, stages, bare = [], [], []
    for i in range(args.runs + 1):
        if i > 0:
            bare.append(bare_jax_start())
        candidate = source + f"\n# candidate {i}\n"
        t0 = time.perf_counter()
        r = evaluate(
            task,
            candidate,
            EvalOptions(tpu=["v5e"], larger_shape=not args.no_larger_shape, zygote=not args.no_zygote),
            store=store,
            work_dir=work,
        )
        wall = time.perf_counter() - t0
        assert r.accepted and not r.cached, r.error
        label = "cold (starts the zygotes, computes the reference estimate)" if i == 0 else "warm"
        print(f"run {i}: {wall:.2f} s  ({r.isolation}, {label})")
        if i == 0:
            cold = wall
            continue
        walls.append(wall)
        stages.append(r.stage_seconds)
        last = r
    print(f"\nfirst candidate of a task: {cold:.2f} s")
    print(
        f"median wall time per evaluation: {statistics.median(walls):.2f} s "
        f"(min {min(walls):.2f}, max {max(walls):.2f}, {len(walls)} runs)"
    )
    print("\nwhere the time goes (median seconds):")
    for name in stages[0]:
        print(f"  {name:<12} {statistics.median(s.get(name, 0.0) for s in stages):.3f}")
    # Judge and candidate stages overlap (they run side by side): the judge's reference against the
    # candidate's load, trace and export, then its TPU compile against the candidate's run of the inputs;
    # interpret_compile (background threads) and judge_warmup (while the judge waits) overlap the others.
    # Start-up is what no stage accounts for.
    inside = statistics.median(max(s.get("reference", 0.0), s.get("load", 0.0) + s.get("trace", 0.0)
                                   + s.get("export", 0.0)) + max(s.get("compile", 0.0), s.get("correctness", 0.0))
                               for s in stages)  # fmt: skip
    print(f"  {'start-up':<12} {statistics.median(walls) - inside:.3f}  (process, sandbox, imports, waiting)")
    corr = last.correctness
    if corr is not None:
        print(f"\ntask inputs: {corr.task_inputs or 'n/a'}; interpret-mode compile per config: "
              f"{', '.join(corr.interpret_compile) or 'n/a'}")  # fmt: skip
    med_bare = statistics.median(bare)
    print(f"\nbare JAX start (measured, interleaved): median {med_bare:.2f} s over {len(bare)} runs")
    print(f"ratio median evaluation / bare JAX start: {statistics.median(walls) / med_bare:.2f}x "
          f"({'zygote' if not args.no_zygote else 'fresh children'}; goal <= 1.5x)")  # fmt: skip


def bare_jax_start() -> float:
    """Wall seconds of the smallest JAX program in a fresh interpreter: the unit the goal is stated in."""
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import jax, jax.numpy as jnp; jnp.ones(3).block_until_ready()"],
        check=True,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
