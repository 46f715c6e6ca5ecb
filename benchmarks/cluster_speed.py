"""The same batch of evaluations on 1 worker, then on a local Ray cluster of N worker processes.

Batch: the bundled example (relu(x @ w + b) at CPU scale) with its kernel, `--evals` distinct candidates
(the kernel with a different trailing comment, so nothing is a store hit), 3 input sets and one TPU
compile (v5e) each — the unit of work a search or an autotune round fans out. Both runs use a fresh
results store and the same task, loaded once.

  1 worker:  the evaluations one after another in this process (today's path without Ray);
  N workers: an embedded Ray instance with N CPUs, the evaluations submitted through `bounded_map` with
             at most N in flight (what `--ray auto` does for autotune configs and search branches).

Prints wall time and evaluations per minute for each and the ratio, all measured in this one run. Each
evaluation runs two sandboxed processes (judge and candidate) that are busy at once, so on a 2-core
machine expect at most ~2x however many workers; the ratio grows with real cores and machines.

    python benchmarks/cluster_speed.py [--evals 8] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from maxkernel.tools import cluster
from maxkernel.tools.harness import EvalOptions, evaluate
from maxkernel.tools.store import ResultsStore
from maxkernel.tools.tasks import KernelTask, load_task

ROOT = Path(__file__).resolve().parents[1]


def batch(task: KernelTask, source: str, n: int, tag: str) -> list[str]:
    return [source + f"\n# {tag} candidate {i}\n" for i in range(n)]


def run_batch(
    task: KernelTask, sources: list[str], work: Path, runner: cluster.RayRunner | None, limit: int
) -> float:
    store = ResultsStore(work / "results.db")
    options = EvalOptions(tpu=["v5e"])

    def one(src: str) -> None:
        r = evaluate(task, src, options, store=store, work_dir=work, runner=runner)
        assert r.accepted and not r.cached, r.error

    t0 = time.perf_counter()
    cluster.bounded_map(one, sources, limit, say=print)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--evals", type=int, default=8, help="evaluations in the batch")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="Ray worker CPUs")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="maxkernel-cluster-speed-"))
    example = ROOT / "examples" / "matmul_bias_relu"
    task = load_task(example, work_dir=work)
    source = (example / "kernel.py").read_text()
    # Warm-up (not counted): the first evaluation of a task also pays for imports into the page cache.
    evaluate(task, source + "\n# warm-up\n", EvalOptions(tpu=["v5e"]), work_dir=work / "warm")

    local_s = run_batch(task, batch(task, source, args.evals, "local"), work / "local", None, 1)
    t0 = time.perf_counter()
    cluster.connect(cluster.LOCAL_ADDRESS, num_cpus=args.workers)
    start_s = time.perf_counter() - t0
    runner = cluster.runner_for(cluster.LOCAL_ADDRESS)
    assert runner is not None
    ray_s = run_batch(task, batch(task, source, args.evals, "ray"), work / "ray", runner, runner.capacity)
    cluster.disconnect()

    def rate(seconds: float) -> float:
        return args.evals / seconds * 60

    print(f"\nmachine: {os.cpu_count()} CPUs; batch: {args.evals} evaluations (measured, wall clock)")
    print(f"1 worker (local, serial):        {local_s:7.1f} s  {rate(local_s):6.1f} evaluations/min")
    print(f"Ray, {args.workers} worker processes (embedded): "
          f"{ray_s:7.1f} s  {rate(ray_s):6.1f} evaluations/min  (+{start_s:.1f} s to start Ray, not counted)")  # fmt: skip
    print(f"ratio (Ray / 1 worker, evaluations/min): {local_s / ray_s:.2f}x")


if __name__ == "__main__":
    main()
